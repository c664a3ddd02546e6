"""The deterministic tiny model that `vllm-nvext serve` uses by default.

A Qwen2-architecture causal LM with seeded random weights (hidden 128, 2 heads of
dim 64, 2 layers) and a byte-level BPE tokenizer with a ChatML chat template. Same
call, same files, same greedy ids: tests and examples rely on it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SEED = 0
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Bumped whenever the generated files change, so cached copies are regenerated.
FORMAT_VERSION = "1"


def default_dir() -> Path:
    """Cache directory for the default model (honours XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-nvext" / f"tiny-model-v{FORMAT_VERSION}"


def _build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Vocabulary: the 256 byte-level symbols, no merges: one token per byte.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int), token_id
    return token_id


def write(directory: str | os.PathLike[str]) -> Path:
    """Write the tiny model and tokenizer into `directory` and return its path."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    vocab_size = len(tokenizer)
    config = Qwen2Config(  # type: ignore[call-arg]
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=_token_id(tokenizer, "<|endoftext|>"),
        eos_token_id=_token_id(tokenizer, "<|im_end|>"),
        torch_dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        # Larger-than-default weights so greedy decoding does not collapse onto one token.
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    # bfloat16 on disk keeps the files under 1 MB; serve with `--dtype float32` (exact upcast).
    model = model.to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    return out


def ensure(directory: str | os.PathLike[str] | None = None) -> Path:
    """Return a directory holding the tiny model, generating it once if needed."""
    out = Path(directory) if directory is not None else default_dir()
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    write(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; its copy is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
