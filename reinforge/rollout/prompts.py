"""Prompt text -> token ids, with the tokenizer's chat template where it has one.

A plain prompt goes to the template as one user message; a conversation
(`reinforge.data.chat.Conversation`: TRL / verl message lists, or a prompt
with prompt.system) goes as its messages, unchanged. Either way the template
adds the generation prompt (add_generation_prompt=True), as TRL does.
"""

from __future__ import annotations

import weakref

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from reinforge.data.chat import Conversation
from reinforge.errors import ConfigError


def use_chat_template(tokenizer: PreTrainedTokenizerBase, mode: str) -> bool:
    if mode == "always" and not tokenizer.chat_template:
        raise ValueError("prompt.chat_template=always, but the tokenizer has no chat template")
    return mode == "always" or (mode == "auto" and bool(tokenizer.chat_template))


def check_chat_prompts(tokenizer: PreTrainedTokenizerBase, mode: str, prompts: list[str]) -> None:
    """ConfigError when some prompt is a conversation but no chat template will format it (a
    conversation has no text form of its own to fall back on), or when the chat template refuses
    the prompts (see `encode_prompts`)."""
    if use_chat_template(tokenizer, mode):
        encode_prompts(tokenizer, prompts, mode)
    elif any(isinstance(p, Conversation) for p in prompts):
        why = "prompt.chat_template=never" if mode == "never" else "the model's tokenizer has no chat template"
        raise ConfigError(f"the prompts are chat messages (a list of messages in the data file, or prompt.system), but "
                          f"{why}: use a model whose tokenizer has a chat_template, or give plain text prompts "
                          "without prompt.system")


def check_context(model_config, tokenizer: PreTrainedTokenizerBase, mode: str, prompts: list[str],
                  max_new_tokens: int, positions_key: str | None = None) -> None:
    """ConfigError when a prompt plus rollout.max_new_tokens does not fit the model's positions
    (n_positions, or max_position_embeddings): past a table of learned positions (GPT-2) generation
    fails deep in transformers with an IndexError, and past the context a rotary model was built for
    (Llama-family) it goes on, out of what it was trained on, with no word. The message counts the
    rows too long, names the longest and the settings that decide. `positions_key`: the setting
    that sizes the model's context, when it is not its config.json's (the built-in model's
    model.max_positions). Prompts are never truncated: a cut prompt asks another question."""
    key = next((k for k in ("n_positions", "max_position_embeddings")
                if isinstance(getattr(model_config, k, None), int)), None)
    if key is None or not prompts:
        return
    limit = getattr(model_config, key)
    lengths = [len(ids) for ids in encode_prompts(tokenizer, prompts, mode)]
    room = limit - max_new_tokens
    over = [i for i, n in enumerate(lengths) if n > room]
    if not over:
        return
    longest = max(over, key=lambda i: lengths[i])
    source = positions_key or f"{key} in its config.json"
    shown = str(prompts[longest])
    shown = repr(shown if len(shown) <= 60 else shown[:57] + "...")
    fixes = [f"set rollout.max_new_tokens={limit - lengths[longest]} or less"] if lengths[longest] < limit else []
    raise ConfigError(
        f"{len(over)} of {len(prompts)} prompts are longer than {max(room, 0)} tokens, the model's {limit} positions "
        f"({source}) less rollout.max_new_tokens={max_new_tokens} (the longest: {lengths[longest]} tokens, "
        f"{shown}): {', or '.join([*fixes, 'remove or shorten those rows of the data'])}; prompts are never "
        "truncated")


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str], mode: str = "auto") -> list[list[int]]:
    """Token ids of each prompt; no special tokens beyond what the chat template adds."""
    if use_chat_template(tokenizer, mode):
        texts = [_apply_chat_template(tokenizer, p) for p in prompts]
    else:
        check_chat_prompts(tokenizer, mode, prompts)
        texts = prompts
    return encode_texts(tokenizer, texts)


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """tokenizer(texts, add_special_tokens=False)["input_ids"], each distinct text encoded once.

    A tokenizer whose encoding is transformers' own over a `tokenizers` backend (no method of it overridden, no
    truncation or padding set on the backend) is called through the backend's batch encode directly; the first
    texts it encodes so are checked against the wrapper's ids, once per tokenizer (any difference: the wrapper).
    Why: the wrapper converts each text's encoding in Python, ~3/4 of the time of the 150,000 SFT traces
    `make run` encodes (~5 s)."""
    distinct = list(dict.fromkeys(texts))
    backend = getattr(tokenizer, "backend_tokenizer", None) if _plain_encoding(type(tokenizer)) else None
    ids = None
    if (backend is not None and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))):
        ids = [e.ids for e in backend.encode_batch(distinct, add_special_tokens=False)]
        if tokenizer not in _BACKEND_CHECKED:
            probe = distinct[:8]
            if tokenizer(probe, add_special_tokens=False)["input_ids"] != ids[: len(probe)]:
                ids = None
            elif probe:
                _BACKEND_CHECKED.add(tokenizer)
    if ids is None:
        ids = tokenizer(distinct, add_special_tokens=False)["input_ids"]
    if len(distinct) == len(texts):
        return ids
    of = dict(zip(distinct, ids, strict=True))
    return [list(of[t]) for t in texts]


_BACKEND_CHECKED: weakref.WeakSet = weakref.WeakSet()   # tokenizers whose backend gave the wrapper's ids


def _plain_encoding(cls: type) -> bool:
    """Whether `cls` encodes text as transformers' `tokenizers`-backed tokenizer does, with nothing overridden."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:     # another transformers layout: the wrapper's encoding
        return False
    return issubclass(cls, TokenizersBackend) and all(
        getattr(cls, name, None) is getattr(base, name, None)
        for name, base in (("__call__", PreTrainedTokenizerBase), ("_call_one", PreTrainedTokenizerBase),
                           ("encode_plus", PreTrainedTokenizerBase), ("batch_encode_plus", PreTrainedTokenizerBase),
                           ("_encode_plus", TokenizersBackend), ("_batch_encode_plus", TokenizersBackend),
                           ("set_truncation_and_padding", TokenizersBackend)))


def _apply_chat_template(tokenizer: PreTrainedTokenizerBase, prompt: str | Conversation) -> str:
    messages = prompt.as_list() if isinstance(prompt, Conversation) else [{"role": "user", "content": prompt}]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as err:
        # Templates call raise_exception() for conversations they refuse (e.g. Llama-2's "a system
        # message is required", or roles that must alternate): the user fixes the prompts, not the code.
        roles = ", ".join(m["role"] for m in messages)
        raise ConfigError(f"the model's chat template refused a prompt with messages ({roles}): {err}; add a system "
                          "message with prompt.system=\"...\", give the messages the template expects in the data "
                          "file, or set prompt.chat_template=never for plain-text prompts") from None
