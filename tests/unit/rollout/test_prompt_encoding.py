"""`rollout.prompts.encode_texts`: the ids transformers' tokenizer call gives, each distinct text encoded once, through
the `tokenizers` backend directly only where that is the wrapper's own encoding."""

from __future__ import annotations

import pytest
from conftest import SPECIALS, byte_bpe
from transformers import PreTrainedTokenizerFast

from reinforge.models import build_tiny_qwen2
from reinforge.rollout.prompts import _plain_encoding, encode_texts
from reinforge.settings import ModelConfig

TEXTS = ["05+34=", "What is 3 + 4?", "", "05+34=", "héllo <|user|> wörld", "<tool_call>x</tool_call>", "05+34="]


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    corpus = [f"What is {a} + {b}? The answer is {a + b}." for a in range(20) for b in range(5)]
    return PreTrainedTokenizerFast(tokenizer_object=byte_bpe(corpus, SPECIALS), pad_token="<pad>",
                                   eos_token="<|end|>", additional_special_tokens=SPECIALS[2:])


@pytest.mark.parametrize("which", ["builtin", "bpe"])
def test_encode_texts_gives_the_tokenizers_ids_and_a_list_per_text(which: str) -> None:
    tok = (build_tiny_qwen2(ModelConfig(added_tokens=["<tool_call>", "</tool_call>"]), seed=0).tokenizer
           if which == "builtin" else bpe_tokenizer())
    assert _plain_encoding(type(tok))
    ids = encode_texts(tok, TEXTS)
    assert ids == tok(TEXTS, add_special_tokens=False)["input_ids"]
    assert ids[2] == [] and len(ids[0]) > 1
    assert len({id(row) for row in ids}) == len(TEXTS)      # repeated texts: lists of their own
    ids[0].append(-1)
    assert ids[3][-1] != -1


def test_encode_texts_uses_the_wrapper_where_the_backend_alone_would_differ() -> None:
    tok = bpe_tokenizer()
    full = tok(TEXTS, add_special_tokens=False)["input_ids"]
    tok.backend_tokenizer.enable_truncation(2)       # the backend truncates; the wrapper turns that off
    assert len(tok.backend_tokenizer.encode("What is 3 + 4?", add_special_tokens=False).ids) == 2
    assert encode_texts(tok, TEXTS) == full

    class Lowered(PreTrainedTokenizerFast):
        def _encode_plus(self, text, *args, **kwargs):
            text = [t.lower() for t in text] if isinstance(text, list) else text.lower()
            return super()._encode_plus(text, *args, **kwargs)

    assert not _plain_encoding(Lowered)
    lowered = Lowered(tokenizer_object=byte_bpe(["What is it"] * 10, SPECIALS), pad_token="<pad>")
    assert encode_texts(lowered, ["What IS"]) == lowered(["what is"], add_special_tokens=False)["input_ids"]
