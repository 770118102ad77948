"""Make the Hugging Face test fixtures under tests/data: tiny random models saved by `transformers`, with reference
logits from torch.

Needs `transformers`, `torch` and `tokenizers` (`pip install -e .[hf]`); CI only reads what this writes. Run it again
to remake the fixtures (the same seed gives the same files):

    python scripts/make_hf_fixture.py [--out-dir tests/data] [--only gpt2,llama,qwen2]
    # the Llama fixture's config.json as transformers v4 writes it (rope_theta + rope_scaling), beside v5's:
    PYTHONPATH=/path/to/transformers-4.57 python scripts/make_hf_fixture.py --only llama-v4-config

What it writes (inputs.npy: int32 [2, 16] token ids; logits.npy: torch's float32 [2, 16, V] logits, eval mode):
  hf-gpt2-tiny    GPT2LMHeadModel (2 layers, d_model 64, 4 heads, 64 positions), a 320-id byte-level BPE; 0.6 MB
  hf-llama-tiny   LlamaForCausalLM: 2 layers, hidden 32, 4 query heads sharing 2 key/value heads (GQA) of width 16
                  (head_dim != hidden / heads), untied lm_head, Llama 3.1's llama3 RoPE scaling with every frequency
                  regime (kept, smoothed, divided), rms_norm_eps 1e-5, one model.safetensors; a 280-id BPE with
                  Llama 3's <|begin_of_text|> / <|end_of_text|>. config-v4.json: the same config as transformers
                  4.57 writes it (made with --only llama-v4-config)
  hf-qwen2-tiny   Qwen2ForCausalLM: 2 layers, hidden 32, 4 query heads sharing 1 (multi-query), q/k/v biases, tied
                  embeddings, rms_norm_eps 1e-6, sharded (model.safetensors.index.json + 3 files); config.json's
                  vocab_size 288 is more than its 270-id tokenizer has, as Qwen2.5's 151936 rows are for 151665 ids

Every parameter is random, biases and norm scales included (transformers' init leaves those at 0 and 1, which would
let a wrong mapping of them pass unnoticed), and the weights are scaled so attention is sharp enough for a wrong
rotary embedding to move the logits far beyond the tests' 1e-5.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import numpy as np

TEXTS = ("textwrap.py", "heapq.py", "bisect.py", "colorsys.py")
LLAMA_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}  # fmt: skip
LLAMA = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
}  # fmt: skip
LLAMA_THETA = 10000.0  # with head width 16 and original_max 32: wavelengths 6.3 (kept), 20 (smoothed), 63+ (divided)


def train_tokenizer(out: Path, vocab_size: int, special: list[str]):
    """A byte-level BPE trained on a few standard-library modules, saved as out/tokenizer.json."""
    from tokenizers import ByteLevelBPETokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tokenizer = ByteLevelBPETokenizer()
    texts = [(stdlib / name).read_text() for name in TEXTS]
    tokenizer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=special)
    tokenizer.save(str(out / "tokenizer.json"))
    return tokenizer


def randomise(model, torch) -> None:
    """Every parameter random: norm scales around 1, biases around 0, matrices of std 1/sqrt(fan-in), an embedding
    of std 1 (1/sqrt(width) when tied: it is the output layer too, and logits of order 1 keep float32's rounding in
    torch and XLA well under the tests' 1e-5)."""
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p) / (p.shape[1] ** 0.5 if tied else 1.0))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)


def reference(model, tokenizer, out: Path, vocab: int, torch) -> None:
    """inputs.npy (2 x 16 ids, the first five the tokens of a line of code) and torch's logits.npy for them."""
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, vocab, size=(2, 16)).astype(np.int32)
    inputs[0, :5] = tokenizer.encode("def wrap(text):").ids[:5]
    with torch.no_grad():
        logits = model(torch.from_numpy(inputs.astype(np.int64))).logits.float().numpy()
    np.save(out / "inputs.npy", inputs)
    np.save(out / "logits.npy", logits)
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}, {total / 1e3:.0f} kB, vocab {logits.shape[-1]}")


def make_gpt2(out: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = train_tokenizer(out, 320, ["<|endoftext|>"])
    vocab, eod = tokenizer.get_vocab_size(), tokenizer.token_to_id("<|endoftext|>")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=eod,
                        eos_token_id=eod, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weight") and p.ndim == 1:  # LayerNorm scales around 1
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(out)
    reference(model, tokenizer, out, vocab, torch)


def make_llama(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(out, 280, ["<|begin_of_text|>", "<|end_of_text|>"])
    vocab = tokenizer.get_vocab_size()
    bos, eos = tokenizer.token_to_id("<|begin_of_text|>"), tokenizer.token_to_id("<|end_of_text|>")
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, **LLAMA,
                         rope_parameters={"rope_theta": LLAMA_THETA, **LLAMA_ROPE})  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    randomise(model, torch)
    model.save_pretrained(out)
    reference(model, tokenizer, out, vocab, torch)


def make_llama_v4_config(out: Path) -> None:
    """out/config-v4.json: the Llama fixture's config as transformers v4 writes it (run under transformers 4.x)."""
    import transformers
    from transformers import LlamaConfig

    assert transformers.__version__.startswith("4."), f"needs transformers 4.x, found {transformers.__version__}"
    ids = json.loads((out / "config.json").read_text())
    config = LlamaConfig(vocab_size=ids["vocab_size"], bos_token_id=ids["bos_token_id"],
                         eos_token_id=ids["eos_token_id"], **LLAMA, rope_theta=LLAMA_THETA, rope_scaling=LLAMA_ROPE,
                         torch_dtype="float32", architectures=["LlamaForCausalLM"])  # fmt: skip
    (out / "config-v4.json").write_text(config.to_json_string())
    print(f"wrote {out / 'config-v4.json'} (transformers {transformers.__version__})")


def make_qwen2(out: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = train_tokenizer(out, 270, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    eod = tokenizer.token_to_id("<|endoftext|>")
    torch.manual_seed(2)
    config = Qwen2Config(
        vocab_size=288, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=eod, eos_token_id=eod, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    randomise(model, torch)
    model.save_pretrained(out, max_shard_size="40KB")
    reference(model, tokenizer, out, tokenizer.get_vocab_size(), torch)


FIXTURES = {"gpt2": ("hf-gpt2-tiny", make_gpt2), "llama": ("hf-llama-tiny", make_llama),
            "qwen2": ("hf-qwen2-tiny", make_qwen2), "llama-v4-config": ("hf-llama-tiny", make_llama_v4_config)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent.parent / "tests/data")
    parser.add_argument("--only", default="gpt2,llama,qwen2", help=f"comma-separated, of: {', '.join(FIXTURES)}")
    args = parser.parse_args()
    for key in args.only.split(","):
        name, make = FIXTURES[key]
        out = args.out_dir / name
        out.mkdir(parents=True, exist_ok=True)
        if key != "llama-v4-config":  # a fresh directory: no stale shards of another layout
            for stale in out.iterdir():
                if stale.name != "config-v4.json":
                    stale.unlink()
        make(out)


if __name__ == "__main__":
    main()
