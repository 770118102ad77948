"""The example tasks' data: JSON-lines files beside this file (the harness's `custom_dataset`), so the tasks are found
wherever jdp is installed. Made by scripts/make_eval_tasks.py."""

from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(name: str = "", **_):
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(HERE / f"{name}.jsonl")})
