"""Make tests/data/hf-gpt2-tiny: a tiny random GPT-2 saved by `transformers`, with reference logits from torch.

Needs `transformers`, `torch` and `tokenizers` (`pip install -e .[hf]`); CI only reads what this writes. Run it again
to remake the fixture (the same seed gives the same files):

    python scripts/make_hf_fixture.py [--out tests/data/hf-gpt2-tiny]

What it writes, all small (about 0.6 MB):
  config.json, model.safetensors   GPT2LMHeadModel.save_pretrained (2 layers, d_model 64, 4 heads, 64 positions)
  tokenizer.json                   a byte-level BPE of 320 ids trained on a few standard-library modules,
                                   with <|endoftext|> as the end-of-document token
  inputs.npy, logits.npy           int32 [2, 16] token ids and float32 [2, 16, 320] logits from torch (eval mode)

Every parameter is random, biases and LayerNorm scales included (GPT-2's init leaves those at 0 and 1, which
would let a wrong mapping of them pass unnoticed).
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests/data/hf-gpt2-tiny")
    args = parser.parse_args()

    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    args.out.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in ("textwrap.py", "heapq.py", "bisect.py", "colorsys.py")]
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts, vocab_size=320, min_frequency=2, special_tokens=["<|endoftext|>"])
    tokenizer.save(str(args.out / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    eod = tokenizer.token_to_id("<|endoftext|>")

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=eod,
        eos_token_id=eod,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weight") and p.ndim == 1:  # LayerNorm scales around 1
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(args.out)

    rng = np.random.default_rng(0)
    inputs = rng.integers(0, vocab, size=(2, 16)).astype(np.int32)
    inputs[0, :5] = tokenizer.encode("def wrap(text):").ids[:5]
    with torch.no_grad():
        logits = model(torch.from_numpy(inputs.astype(np.int64))).logits.float().numpy()
    np.save(args.out / "inputs.npy", inputs)
    np.save(args.out / "logits.npy", logits)
    total = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out}: {sorted(p.name for p in args.out.iterdir())}, {total / 1e6:.2f} MB, vocab {vocab}")


if __name__ == "__main__":
    main()
