"""The built-in character-level tokenizer, and tokenizer loading that keeps it.

A character tokenizer saved next to a Qwen2 `config.json` is silently replaced
by Qwen2's byte-level tokenizer when loaded with `AutoTokenizer` (the config's
model type wins). `load_tokenizer` therefore reads the saved tokenizer class
first and loads a plain `PreTrainedTokenizerFast` directly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from reinforge.models.charset import CHARSET, SPECIAL_TOKENS


def build_char_tokenizer(added_tokens: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """One token per character of CHARSET, plus <pad>, <eos>, <unk>; no BOS. Each of `added_tokens` (say
    "<tool_call>") is one more token after those, matched in text before the split into characters; not
    special, so decoding with skip_special_tokens keeps it, as a tool parser needs."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARSET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Split before every character: each character is one "word" of WordLevel.
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
    for token in added_tokens:
        if len(token) < 2 or token in vocab or token in tokenizer.get_added_vocab():
            raise ValueError(f"model.added_tokens: {token!r} is a character of the built-in tokenizer already, "
                             "empty or listed twice; each added token is a string of two or more characters")
        tokenizer.add_tokens([token])
    return tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in `path`, never swapping a plain fast tokenizer for the model's."""
    path = Path(path)
    config_file = path / "tokenizer_config.json"
    tokenizer_class = None
    if config_file.is_file():
        tokenizer_class = json.loads(config_file.read_text()).get("tokenizer_class")
    if tokenizer_class in ("PreTrainedTokenizerFast", "TokenizersBackend") and (path / "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        # Causal LMs often ship without a pad token; eos is the usual stand-in
        # (padding positions are masked out everywhere).
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer
