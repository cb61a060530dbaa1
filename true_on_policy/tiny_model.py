"""Small random-init Qwen3-MoE checkpoints (and a byte-level tokenizer) built locally.

Nothing is downloaded: transformers' ``Qwen3MoeForCausalLM`` is initialised from a seed and
saved as ``save_pretrained`` saves it (a real-shape one a shard at a time, ``save_in_shards``). Builds are cached under ``$TRUE_ON_POLICY_CACHE`` (default
``~/.cache/true_on_policy``) in a folder named after a hash of the geometry, written to a
temporary folder first and renamed, so concurrent builders never see half a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from true_on_policy import env

# The embedded default: small enough to build on a CPU in seconds, every Qwen3-MoE feature on.
EMBEDDED = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=4096,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, initializer_range=0.05, seed=0,
)
# A second geometry (more experts, top-4, 8 query heads / 2 KV heads, head_dim 128, 4 layers).
WIDE = dict(EMBEDDED, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, head_dim=128, num_experts=16, num_experts_per_tok=4,
            moe_intermediate_size=96, seed=1)
# Awkward layouts, each on the embedded geometry: YaRN with a small original context (prompts
# run past it), a head group that does not divide the 64-row attention tile, an odd vocabulary.
YARN = dict(EMBEDDED, max_position_embeddings=1024, seed=2,
            rope_scaling={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64})
# YaRN at the 2507 / Coder context: x8 from 32768 to 262144 positions (a prompt near that length
# runs through chunked prefill, split-KV decode and the trainer's full-sequence attention).
YARN262K = dict(EMBEDDED, max_position_embeddings=262144, seed=5,
                rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32768})
GROUP3 = dict(EMBEDDED, num_attention_heads=6, num_key_value_heads=2, seed=3)
VOCAB3001 = dict(EMBEDDED, vocab_size=3001, seed=4)
# The real Qwen3-30B-A3B layer geometry (hidden 2048, 32/4 heads of 128, 128 experts top-8,
# moe_intermediate 768, vocab 151936) at 6 layers (the throughput benchmark's model) and at its full
# 48 layers. Random bf16 weights, built on the GPU when there is one (a CPU init takes minutes).
A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
           num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
           num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
           rope_theta=1_000_000.0, rms_norm_eps=1e-6, initializer_range=0.02, seed=10)
A3B48 = dict(A3B, num_hidden_layers=48, seed=11)
# The same layer geometry at an odd layer count (5): pipeline stages split it unevenly (2 + 3).
A3B5 = dict(A3B, num_hidden_layers=5, seed=12)
# The layer geometries of the larger checkpoints, 2 layers each: Qwen3-235B-A22B (hidden
# 4096, 64/4 heads, 128 experts, moe_intermediate 1536; ~12 GB) and Qwen3-Coder-480B-A35B (hidden
# 6144, 96/8 heads: a group of 12, 160 experts, moe_intermediate 2560, 262144 positions; ~34 GB).
A22B2 = dict(A3B, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=2,
             num_attention_heads=64, num_key_value_heads=4, seed=13)
A35B2 = dict(A3B, hidden_size=6144, intermediate_size=8192, moe_intermediate_size=2560, num_hidden_layers=2,
             num_attention_heads=96, num_key_value_heads=8, num_experts=160, max_position_embeddings=262144,
             seed=14)
GEOMETRIES = {"embedded": EMBEDDED, "wide": WIDE, "yarn": YARN, "yarn262k": YARN262K, "group3": GROUP3, "vocab3001": VOCAB3001,
              "a3b6": A3B, "a3b48": A3B48, "a3b5": A3B5, "a22b2": A22B2, "a35b2": A35B2}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # one file, or shards and their index
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_root() -> Path:
    return Path(env.CACHE_DIR.get() or Path.home() / ".cache" / "true_on_policy")


def _key(spec: dict) -> str:
    import transformers

    blob = json.dumps({"spec": spec, "transformers": transformers.__version__, "format": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[0])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def hf_config(spec: dict, **tokens):
    """The ``Qwen3MoeConfig`` of geometry ``spec`` (its seed left out), every layer sparse;
    ``tokens``: the tokenizer's special ids."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **{k: v for k, v in spec.items() if k != "seed"}, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False, torch_dtype="bfloat16", architectures=["Qwen3MoeForCausalLM"], **tokens,
    )


def build(folder: Path, spec: dict) -> None:
    import torch
    from transformers import Qwen3MoeForCausalLM

    spec = dict(spec)
    seed = spec.pop("seed")
    tok = build_tokenizer(folder)
    cfg = hf_config(spec, eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=tok.pad_token_id)
    gen = torch.manual_seed(seed)
    # the small geometries keep their fp32 init (then rounded); a real-shape one is initialised
    # in bf16 on the GPU when there is one (a 30B model in fp32 would not fit, a CPU init is slow)
    large = spec["num_hidden_layers"] * spec["num_experts"] * spec["hidden_size"] * spec["moe_intermediate_size"] > 1e9
    device = "cuda" if large and torch.cuda.is_available() else "cpu"
    default = torch.get_default_dtype()
    if large:
        torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():  # non-trivial norm weights, so weight rounding is exercised too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    model.to(torch.bfloat16)
    if large:
        save_in_shards(model, folder)
    else:
        model.save_pretrained(folder)
    if device == "cuda":  # hand the GPU memory back before an engine starts in another process
        del model
        torch.cuda.empty_cache()


def save_in_shards(model, folder: Path, shard_bytes: int = 5 * 2**30) -> None:
    """``model`` written as ``save_pretrained`` writes it (checkpoint names, config, generation config),
    ``shard_bytes`` of whole layers a shard, each shard's tensors converted to checkpoint form, moved to
    host memory and written before the next: ``save_pretrained`` converts the whole state dict at once
    (the fused experts split into a second copy), more than an 80 GB card holds at real-shape sizes; here
    one shard's converted copy exists at a time."""
    import torch
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    units: dict[str, list[str]] = {}  # one unit a decoder layer (its tensors are converted together)
    for k in state:
        parts = k.split(".")
        units.setdefault(".".join(parts[:3]) if parts[:2] == ["model", "layers"] else k, []).append(k)
    shards, size = [[]], 0
    for keys in units.values():
        nbytes = sum(state[k].numel() * state[k].element_size() for k in keys)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(keys)
        size += nbytes
    weight_map, total = {}, 0
    for i, keys in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        part = {k: v.to("cpu").contiguous() for k, v in revert_weight_conversion(model, {k: state[k] for k in keys}).items()}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        total += sum(v.numel() * v.element_size() for v in part.values())
        del part
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    model.config.save_pretrained(folder)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(folder)


def build_into(final: Path, spec: dict) -> str:
    """Build ``spec`` into the folder ``final`` unless a checkpoint is already there: written to a
    temporary sibling first and renamed, so a concurrent builder never sees half a checkpoint."""
    final = Path(final)
    if (final / "config.json").is_file() and any((final / f).is_file() for f in WEIGHT_FILES):
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        build(tmp, spec)
        (tmp / "true_on_policy_geometry.json").write_text(json.dumps(spec, indent=1, sort_keys=True))
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race: keep theirs
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def folder_for(name: str, spec: dict, root: Path | None = None) -> Path:
    """The cache folder of ``spec`` under the name ``name`` (the hash of the spec keeps two specs apart)."""
    return Path(root or cache_root()) / f"qwen3-moe-{name}-{_key(spec)}"


def ensure(geometry: str = "embedded") -> str:
    """Path of the cached checkpoint of ``geometry``, building it on first use."""
    try:
        spec = GEOMETRIES[geometry]
    except KeyError:
        raise KeyError(f"unknown tiny geometry {geometry!r}; known: {', '.join(GEOMETRIES)}") from None
    return build_into(folder_for(geometry, spec), spec)
