"""Make the LoRA test fixtures under tests/data: PEFT adapters on the tiny Llama and Qwen2 fixtures, with peft's
logits and adapter gradients as references (tests/test_adapters.py compares jdp's with them; CI needs no torch).

Needs `torch`, `transformers` and `peft`. Run it again to remake them (the same seed gives the same files):

    python scripts/make_lora_fixture.py [--out-dir tests/data]

What it writes, per base (hf-llama-tiny, hf-qwen2-tiny) into lora-<base>/:
  adapter_config.json, adapter_model.safetensors  PeftModel.save_pretrained's two files
  logits.npy   float32 [2, 16, V]: the PeftModel's logits on the base's inputs.npy (eval mode)
  grads.npz    float32: the gradient of the loss below by every adapter tensor, keyed by its name in the file
  loss.npy     the loss: the summed next-token cross-entropy of inputs.npy (the last position unweighted)

lora-llama-tiny: rank 4, alpha 8, all-linear, lm_head trained whole (modules_to_save); lora-qwen2-tiny: rank 2,
alpha 4, q_proj,v_proj,down_proj, rsLoRA (alpha / sqrt(r)). init_lora_weights=False draws B at random, so the
adapters move the logits (a B left at zero would make any mapping of A pass).
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import numpy as np

SETS = {
    "llama": dict(base="hf-llama-tiny", r=4, lora_alpha=8, target_modules="all-linear", modules_to_save=["lm_head"]),
    "qwen2": dict(base="hf-qwen2-tiny", r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"],
                  use_rslora=True),
}  # fmt: skip


def loss_of(logits, inputs, torch):
    """The summed cross-entropy of each next token (the last position has none)."""
    targets = torch.roll(inputs, -1, dims=1)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    weights = torch.ones_like(inputs, dtype=torch.float32)
    weights[:, -1] = 0
    return (nll * weights.reshape(-1)).sum()


def make(name: str, spec: dict, data: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    spec = dict(spec)
    base = data / spec.pop("base")
    out = data / f"lora-{base.name}"
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **spec))
    with torch.no_grad():  # the module trained whole: moved from the base's, so a base read in its place is seen
        for n, p in peft.named_parameters():
            if "modules_to_save" in n:
                p.add_(0.05 * torch.randn_like(p))
    peft.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)
    (out / "adapter_model.safetensors").chmod(0o644)  # peft writes it owner-only
    inputs = torch.from_numpy(np.load(base / "inputs.npy").astype(np.int64))
    logits = peft(inputs).logits
    loss = loss_of(logits, inputs, torch)
    loss.backward()
    grads = {}
    for n, p in peft.named_parameters():
        if p.requires_grad:  # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight -> the file's
            key = n.replace(".default", "").replace(".modules_to_save", "").replace(".original_module", "")
            grads[key] = p.grad.detach().numpy().astype(np.float32)
    np.save(out / "logits.npy", logits.detach().numpy().astype(np.float32))
    np.save(out / "loss.npy", np.float32(loss.item()))
    np.savez(out / "grads.npz", **grads)
    print(f"{out}: {len(grads)} adapter gradients, loss {loss.item():.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "data")
    args = p.parse_args()
    for name, spec in SETS.items():
        make(name, spec, args.out_dir)


if __name__ == "__main__":
    main()
