"""The model section of the config: every family's keys in one frozen dataclass (each family says which of them
it reads, jdp/models/__init__.py, and refuses the others when they are set)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LORA_KEYS", "SHARED_KEYS", "ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 320  # the byte tokenizer's 257 ids, padded to a multiple of 64
    max_seq_len: int = 256  # learned positions: the longest sequence the model supports
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    dtype: str = "float32"  # compute dtype (bfloat16 on GPUs)
    param_dtype: str = "float32"  # parameters and optimizer state stay float32
    # auto (cuDNN's kernel on GPUs for bf16/fp16, XLA's for float32; einsum elsewhere), einsum, xla or cudnn
    attention: str = "auto"
    bias: bool = False  # biases in every projection (GPT-2 has them)
    vocab_valid: int = 0  # ids from here to vocab_size are padding and never get probability; 0: none are
    # the family (jdp/models/): gpt, learned positions, LayerNorm, GELU MLP, multi-head attention, biases by
    # model.bias (gpt.py); llama, rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention (Llama, Qwen2,
    # Mistral, SmolLM; llama.py); or one a user registered (jdp.models.register)
    arch: str = "gpt"
    norm_eps: float = 1e-5  # every norm's epsilon (GPT's LayerNorm, Llama's RMSNorm)
    # The keys below are Llama's (its family's KEYS): with another family they keep their defaults.
    n_kv_heads: int = 0  # key/value heads, dividing n_heads (1: multi-query attention); 0: n_heads (multi-head)
    d_ff: int = 0  # SwiGLU hidden width; 0: 8/3 d_model rounded up to a multiple of 64 (Llama's rule)
    head_dim: int = 0  # width of each attention head (even: RoPE rotates pairs); 0: d_model / n_heads
    rope_theta: float = 10000.0  # RoPE base: head pair i turns at theta^(-2i/head_dim) radians per position
    rope_scaling: str = ""  # "": plain RoPE; llama3: Llama 3.1's frequency scaling, by the four keys below
    rope_factor: float = 8.0  # llama3: the lowest frequencies are divided by this
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above rope_original_max_len / this are divided
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below rope_original_max_len / this are kept
    rope_original_max_len: int = 8192  # llama3: the context the model was first trained at
    qkv_bias: bool = False  # biases on the q, k and v projections only (Qwen2)
    tie_embeddings: bool = True  # the output projection is the token embedding (GPT's always is); false: lm_head
    # The padding token's embedding row (config.json's pad_token_id, set by an import): its lookups pass no gradient
    # to it, as transformers' nn.Embedding(padding_idx=...) has it; -1: none
    pad_id: int = -1
    # Activation recomputation in backward (jdp/parallel/remat.py): none, dots (keep the projections' outputs,
    # recompute attention, norms and activations: MaxText's minimal) or full (keep each block's input only)
    remat: str = "none"
    remat_every: int = 1  # recompute blocks 0, N, 2N, ... and keep the others' activations (1: every block)
    # LoRA (jdp/adapters.py, docs/adapters.md): the rank r of the adapters on the targeted linear layers; 0: off,
    # every parameter trains. With r > 0 only the adapters (and lora_modules_to_save) train; the base is frozen
    lora_rank: int = 0
    lora_alpha: float = 8.0  # the adapters' output is scaled by lora_alpha / r (PEFT's default alpha, 8)
    lora_dropout: float = 0.0  # dropout on the adapters' input (PEFT's lora_dropout)
    # which linear layers get adapters, by the names PEFT's target_modules uses for the family (Llama's q_proj,
    # k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; GPT-2's c_attn, c_proj, c_fc), or all-linear (every
    # linear layer but the output head)
    lora_targets: str = "all-linear"
    lora_rslora: bool = False  # scale by lora_alpha / sqrt(r) (rsLoRA, PEFT's use_rslora)
    lora_modules_to_save: str = ""  # modules that train whole beside the adapters (PEFT's names: embed_tokens, lm_head)
    base_dtype: str = ""  # the frozen base's dtype (bfloat16 halves its bytes); "": model.param_dtype

    @property
    def kv_heads(self) -> int:
        """Key/value heads (G): n_kv_heads, or n_heads when it is 0 (GPT's always are)."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_width(self) -> int:
        """Each head's width (K): head_dim, or d_model / n_heads when it is 0 (GPT's always is)."""
        return self.head_dim or self.d_model // self.n_heads


# The keys every family reads (the rest are a family's own: its KEYS).
SHARED_KEYS = ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "dtype", "param_dtype", "attention",
               "vocab_valid", "arch", "norm_eps", "pad_id", "remat", "remat_every", "lora_rank", "lora_alpha",
               "lora_dropout", "lora_targets", "lora_rslora", "lora_modules_to_save", "base_dtype")  # fmt: skip
# The LoRA keys: read only with model.lora_rank > 0
LORA_KEYS = ("lora_alpha", "lora_dropout", "lora_targets", "lora_rslora", "lora_modules_to_save", "base_dtype")
