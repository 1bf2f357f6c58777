"""Build a tiny random-weight DeepSeek-V2-style (MLA) checkpoint, with the local tokenizer of
tests/models/build_tiny_llama.py, that vLLM's CPU MLA backend can run.

    build_tiny_deepseek(out_dir) -> out_dir

Idempotent like build_tiny_llama (a marker file records the parameters; a second call with
the same ones returns at once). Never touches the network.

Shape constraints (vLLM 0.32 CPU): the reference CPU MLA backend's decode kernel compiles only
for a 576-value latent, so ``kv_lora_rank`` is 512 and ``qk_rope_head_dim`` 64, as in
DeepSeek-V2/V3; everything else is small. All layers are dense MLPs (``first_k_dense_replace``
= layers): MoE is not what is under test. The rotary embedding is DeepSeek's YaRN variant, as
in the real checkpoints; it also matters here: with plain rope vLLM's CPU ``rotary_embedding``
kernel rotates the MLA key (a strided view of the latent projection) as if it were contiguous,
so a prefill of more than one token caches wrong rotary keys for every token but the first,
and a run that loads the prompt's KV (its last token then computed alone, correctly) parts
from a run that computed it (seen as different greedy tokens with byte-identical loaded
latents). vLLM's YaRN rope runs in PyTorch and honours the strides.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from engine_jobs import load_model_builder

FORMAT_VERSION = 1
LATENT_DIM = 576  # kv_lora_rank 512 + qk_rope_head_dim 64


def build_tiny_deepseek(
    out_dir: Path,
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    intermediate: int = 512,
    vocab: int = 2048,
    max_positions: int = 8192,
    seed: int = 0,
    init_std: float = 0.3,
) -> Path:
    """Write the checkpoint into ``out_dir`` (created) unless it is already there; return it.
    ``init_std`` as in build_tiny_llama: large enough that greedy outputs depend on the KV."""
    llama = load_model_builder()
    out_dir = Path(out_dir)
    params = {
        "format": FORMAT_VERSION,
        "kind": "deepseek_v2",
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "intermediate": intermediate,
        "vocab": vocab,
        "max_positions": max_positions,
        "seed": seed,
        "init_std": init_std,
    }
    if llama.is_built(out_dir, params):
        return out_dir
    for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
        os.environ.setdefault(name, value)

    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, GenerationConfig

    config = DeepseekV2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=None,  # DeepSeek-V2-Lite: queries projected directly
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        head_dim=64,
        # required fields of the config class; no layer is MoE (first_k_dense_replace)
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        first_k_dense_replace=layers,
        max_position_embeddings=max_positions,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": max_positions // 4,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        initializer_range=init_std,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(config).to(torch.bfloat16).eval()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-deepseek-", dir=out_dir.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(staging)
        llama._build_tokenizer(vocab, max_positions, seed).save_pretrained(staging)
        staging.chmod(0o755)
        (staging / llama.MARKER).write_text(json.dumps(params, indent=1, sort_keys=True))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)  # atomic: a half-built directory never carries the marker
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
