"""Conversations as the model's tokens: the opening prompt, and the tokens an environment's reply
adds after a model turn.

With a chat template (the tokenizer has one and prompt.chat_template allows it) both are the
template's own rendering, with the tools' schemas passed as `apply_chat_template(..., tools=...)`
so the system prompt lists them as the model family expects. A reply's tokens are what the template
writes between the end of the model's turn and the start of the next: the end-of-turn marker the
model did not write itself (it stopped on `</tool_call>` rather than its end token), the reply
messages, and the next generation prompt. They are found by rendering the conversation with a
sentinel as the model's turn and cutting at it, because the template's text for the model's turn
need not equal the text the model sampled (whitespace, stripped reasoning), while the context the
engine continues is the tokens it sampled.

Without a template (the built-in character model) the conversation is plain text: the opening
messages' contents joined by newlines, a tool's result as `<tool_response>...</tool_response>`
(the Hermes form) and any other reply message as its content and a newline.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from reinforge.agents.episode import Message
from reinforge.rollout.prompts import use_chat_template

_SENTINEL = "\u2063REINFORGE-TURN\u2063"


class Renderer:
    """A tokenizer's rendering of agent conversations (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str = "auto", tools: list[dict] | None = None,
                 eos_token_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.templated = use_chat_template(tokenizer, chat_template)
        self.tools = tools or None
        self.eos_ids = set(eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text, in one call of the tokenizer (a call per text costs ~50 us of overhead)."""
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    def prompt(self, messages: list[Message]) -> list[int]:
        """The opening messages with the generation prompt."""
        return self.encode(self.prompt_text(messages))

    def prompt_text(self, messages: list[Message]) -> str:
        if not self.templated:
            return "\n".join(str(m["content"]) for m in messages)
        return self._template(messages, generation_prompt=True)

    def reply(self, before: list[Message], after: list[Message], turn_ids: list[int]) -> list[int]:
        """The tokens after the model's turn (`turn_ids`, the last message of `before`) when the reply
        extends the conversation from `before` to `after`, through the next turn's generation prompt."""
        return self.encode(self.reply_text(before, after, turn_ids))

    def reply_text(self, before: list[Message], after: list[Message], turn_ids: list[int]) -> str:
        """The text `reply` tokenizes (of `turn_ids`, only whether the last is an end token matters)."""
        reply = after[len(before):]
        if not self.templated:
            return "".join(_plain(m) for m in reply)
        probe = [*before[:-1], {**before[-1], "content": _SENTINEL}]
        closed = self._template(probe, generation_prompt=False)
        opened = self._template(probe + reply, generation_prompt=True)
        cut = closed.rindex(_SENTINEL) + len(_SENTINEL)
        if not opened.startswith(closed[:cut]):
            raise ValueError("the chat template renders the earlier turns differently once a reply follows; "
                             "multi-turn rollouts need a template whose rendering of a conversation is a prefix "
                             "of its rendering of the same conversation continued")
        trailer = opened[cut:]
        if turn_ids and turn_ids[-1] in self.eos_ids:
            # The model ended its turn with its end token, which the template writes right after the content.
            end = self.tokenizer.decode([turn_ids[-1]])
            if trailer.startswith(end):
                trailer = trailer[len(end):]
        return trailer

    def ignores_tools(self) -> bool:
        """Whether the chat template renders a conversation the same with and without the tools' schemas:
        it never shows the model its tools. False without tools or without a template (plain text)."""
        if not self.templated or not self.tools:
            return False
        probe: list[Message] = [{"role": "user", "content": "Hi"}]
        with_tools = self._template(probe, generation_prompt=True)
        return with_tools == self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)

    def _template(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)


def _plain(message: Message) -> str:
    if message["role"] == "tool":
        return f"<tool_response>{message['content']}</tool_response>"
    return f"{message['content']}\n"


def trace_tokens(renderer: Renderer, opening: list[Message], turns: list[Message],
                 eos_id: int) -> tuple[list[int], list[int], list[float]]:
    """A teacher's conversation as the rollout would hold it: (prompt ids, completion ids, loss mask).
    Each model turn is its content's tokens and `eos_id` (trained on); each run of other messages is the
    reply the renderer writes after the turn before it (context only)."""
    return trace_tokens_many(renderer, [(opening, turns)], eos_id)[0]


def trace_tokens_many(renderer: Renderer, conversations: list[tuple[list[Message], list[Message]]],
                      eos_id: int) -> list[tuple[list[int], list[int], list[float]]]:
    """`trace_tokens` of each (opening, turns), every text of every conversation tokenized in one call: an SFT
    set of tool episodes is tens of thousands of conversations of a few texts each."""
    pieces = [_trace_texts(renderer, opening, turns, eos_id) for opening, turns in conversations]
    ids = iter(renderer.encode_many([text for texts in pieces for text, _ in texts]))
    traces = []
    for texts in pieces:
        prompt = next(ids)
        completion: list[int] = []
        trained: list[float] = []
        for _, turn in texts[1:]:
            part = next(ids) + ([eos_id] if turn else [])
            completion += part
            trained += [1.0 if turn else 0.0] * len(part)
        traces.append((prompt, completion, trained))
    return traces


def _trace_texts(renderer: Renderer, opening: list[Message], turns: list[Message],
                 eos_id: int) -> list[tuple[str, bool]]:
    """The texts a trace's tokens are made of, in order, each with whether it is a model turn (its tokens and
    `eos_id`, trained on): the prompt first, then the turns and the replies between them."""
    texts = [(renderer.prompt_text(opening), False)]
    messages, at, turned = list(opening), 0, False
    while at < len(turns):
        if turns[at]["role"] == "assistant":
            texts.append((str(turns[at]["content"]), True))
            messages.append(turns[at])
            turned, at = True, at + 1
            continue
        end = at
        while end < len(turns) and turns[end]["role"] != "assistant":
            end += 1
        # the turn before the reply ends with eos_id, which is all `reply_text` reads of a turn's tokens
        texts.append((renderer.reply_text(messages, messages + list(turns[at:end]), [eos_id] if turned else []),
                      False))
        messages += list(turns[at:end])
        at = end
    return texts
