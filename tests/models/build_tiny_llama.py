"""Build a tiny random-weight Llama checkpoint (plus a local tokenizer) that vLLM can load.

Usable as a module (`build_tiny_llama(out_dir, ...)`) and as a script:

    python tests/models/build_tiny_llama.py OUT_DIR [--layers N --hidden N --heads N
        --kv-heads N --head-dim N --intermediate N --vocab N --max-positions N --seed N]

Never touches the network. Idempotent: a marker file records the parameters the directory was
built with; a second call with the same parameters returns at once.

The weights are drawn with a standard deviation much larger than Llama's default
initializer_range (0.02). With 0.02 the attention and MLP contributions are tiny next to the
token embedding, so greedy outputs barely depend on the context (and so on the KV cache); with
`init_std` 0.3 different prompts give different greedy continuations and a changed prefix
changes the output, which the connector tests and the TTFT benchmark rely on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

MARKER = "kvfabric_tiny_llama.json"
FORMAT_VERSION = 1
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def _params(**kwargs) -> dict:
    return {"format": FORMAT_VERSION, **kwargs}


def is_built(out_dir: Path, params: dict | None = None) -> bool:
    """True if `out_dir` holds a complete model (built with `params`, when given)."""
    marker = Path(out_dir) / MARKER
    try:
        stored = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return params is None or stored == params


def _corpus(vocab_words: list[str], lines: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choices(vocab_words, k=rng.randint(4, 32))) for _ in range(lines)]


def _build_tokenizer(vocab: int, max_positions: int, seed: int):
    """A WordLevel tokenizer trained on a generated corpus that covers exactly `vocab` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab - len(SPECIAL_TOKENS))]
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Every word once (so every id exists) plus random lines for realistic frequencies.
    corpus = [" ".join(words), *_corpus(words, 2000, seed)]
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab, min_frequency=1, special_tokens=SPECIAL_TOKENS
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with spaces
    assert tokenizer.get_vocab_size() == vocab, tokenizer.get_vocab_size()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        model_max_length=max_positions,
    )


def build_tiny_llama(
    out_dir: Path,
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    intermediate: int = 512,
    vocab: int = 2048,
    max_positions: int = 8192,
    seed: int = 0,
    init_std: float = 0.3,
) -> Path:
    """Write the checkpoint into `out_dir` (created) unless it is already there; return it."""
    out_dir = Path(out_dir)
    params = _params(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        max_positions=max_positions,
        seed=seed,
        init_std=init_std,
    )
    if is_built(out_dir, params):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MARKER).exists():
        raise FileExistsError(f"{out_dir} is not empty and holds no tiny model; not replacing it")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # weights ~ N(0, init_std), norms 1
    model = model.to(torch.bfloat16).eval()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=out_dir.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(staging)
        _build_tokenizer(vocab, max_positions, seed).save_pretrained(staging)
        staging.chmod(0o755)
        (staging / MARKER).write_text(json.dumps(params, indent=1, sort_keys=True))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)  # atomic: a half-built directory never carries the marker
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    for name, default in [
        ("layers", 4),
        ("hidden", 256),
        ("heads", 4),
        ("kv-heads", 2),
        ("head-dim", 64),
        ("intermediate", 512),
        ("vocab", 2048),
        ("max-positions", 8192),
        ("seed", 0),
    ]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--init-std", type=float, default=0.3)
    args = parser.parse_args(argv)
    path = build_tiny_llama(
        args.out_dir,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate=args.intermediate,
        vocab=args.vocab,
        max_positions=args.max_positions,
        seed=args.seed,
        init_std=args.init_std,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
