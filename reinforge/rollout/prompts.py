"""Prompt text -> token ids, with the tokenizer's chat template where it has one.

A plain prompt goes to the template as one user message; a conversation
(`reinforge.data.chat.Conversation`: TRL / verl message lists, or a prompt
with prompt.system) goes as its messages, unchanged. Either way the template
adds the generation prompt (add_generation_prompt=True), as TRL does.
"""

from __future__ import annotations

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
                  max_new_tokens: int) -> None:
    """ConfigError when a prompt plus rollout.max_new_tokens does not fit a model with a table of learned
    positions (GPT-2's `n_positions`): generation would index past it, an IndexError deep in transformers.
    Models without one (rotary: the Llama family) are not checked."""
    limit = getattr(model_config, "n_positions", None)
    if not isinstance(limit, int) or not prompts:
        return
    longest = max(len(ids) for ids in encode_prompts(tokenizer, prompts, mode))
    if longest + max_new_tokens <= limit:
        return
    fix = (f"set rollout.max_new_tokens={limit - longest} or less, or shorten the prompts" if longest < limit
           else "shorten the prompts")
    raise ConfigError(f"the longest prompt ({longest} tokens) + rollout.max_new_tokens ({max_new_tokens}) exceed the "
                      f"model's {limit} positions (n_positions in its config.json): {fix}")


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str], mode: str = "auto") -> list[list[int]]:
    """Token ids of each prompt; no special tokens beyond what the chat template adds."""
    if use_chat_template(tokenizer, mode):
        texts = [_apply_chat_template(tokenizer, p) for p in prompts]
    else:
        check_chat_prompts(tokenizer, mode, prompts)
        texts = prompts
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


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
