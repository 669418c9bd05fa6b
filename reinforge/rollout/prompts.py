"""Prompt text -> token ids, with the tokenizer's chat template where it has one."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def use_chat_template(tokenizer: PreTrainedTokenizerBase, mode: str) -> bool:
    if mode == "always" and not tokenizer.chat_template:
        raise ValueError("prompt.chat_template=always, but the tokenizer has no chat template")
    return mode == "always" or (mode == "auto" and bool(tokenizer.chat_template))


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str], mode: str = "auto") -> list[list[int]]:
    """Token ids of each prompt; no special tokens beyond what the chat template adds."""
    if use_chat_template(tokenizer, mode):
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    else:
        texts = prompts
    return tokenizer(texts, add_special_tokens=False)["input_ids"]
