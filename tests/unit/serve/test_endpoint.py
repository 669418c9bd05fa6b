"""The policy as an OpenAI-compatible endpoint (reinforge/serve): what it returns is what the engine
sampled, every returned token is recorded against its episode, and the trajectory built from the
records is exactly those tokens, the chat template's tokens between them out of the loss."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from repo_paths import REPO
from scripted_engine import Scripted

from reinforge.models.factory import load_policy
from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.rollout import HFEngine, NativeEngine
from reinforge.rollout.base import SamplingParams
from reinforge.serve.endpoint import Endpoint
from reinforge.serve.records import chains, trajectory
from reinforge.settings import ModelConfig

PARAMS = SamplingParams(max_new_tokens=6)


@pytest.fixture(scope="module")
def policy(llama_dir):
    return load_policy(ModelConfig(path=str(llama_dir)), 0)


def client(endpoint: Endpoint, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.url, api_key=key, max_retries=0, timeout=60)


def test_the_token_route_returns_the_engines_own_samples_and_their_log_probs(policy) -> None:
    engine = NativeEngine(policy)
    prompt = policy.tokenizer("What is 2 + 3?", add_special_tokens=False)["input_ids"]
    endpoint = Endpoint(engine)
    with endpoint, endpoint.serving(PARAMS):
        log = endpoint.open_episode(key=1234)
        answer = httpx.post(f"{endpoint.url}/generate", json={"input_ids": prompt, "n": 3},
                            headers={"Authorization": f"Bearer {log.token}"}, timeout=60).json()
    # The same request of the engine itself, from the same key: the same tokens and log-probs.
    direct = engine.generate_ids([prompt], 3, PARAMS, group_keys=torch.tensor([1234]))
    for r, choice in enumerate(answer["choices"]):
        n = int(direct.completion_mask[r].sum())
        assert choice["output_ids"] == direct.completion_ids[r, :n].tolist()
        assert choice["logprobs"] == pytest.approx(direct.sampler_logprobs[r, :n].tolist(), abs=1e-6)
        assert choice["versions"] == [0] * n
    # Recorded as returned; at temperature 1 the sampler's log-probs are the model's own (a forward pass).
    assert [c.token_ids.tolist() for c in log.calls] == [c["output_ids"] for c in answer["choices"]]
    call = log.calls[0]
    ids = torch.tensor([list(call.context)])
    with torch.no_grad():
        logits = policy.model(ids).logits[0, len(prompt) - 1: -1]
    forward = torch.log_softmax(logits.float(), -1).gather(1, call.token_ids[:, None])[:, 0]
    torch.testing.assert_close(call.sampler_logprobs, forward, atol=1e-4, rtol=0)


@pytest.mark.parametrize("engine_kind", ["native", "hf"])
def test_a_chat_conversation_trains_on_exactly_the_tokens_the_endpoint_returned(policy, engine_kind: str) -> None:
    engine = NativeEngine(policy) if engine_kind == "native" else HFEngine(policy)
    endpoint = Endpoint(engine)
    with endpoint, endpoint.serving(PARAMS):
        log = endpoint.open_episode(key=7)
        c = client(endpoint, log.token)
        assert [m.id for m in c.models.list().data] == ["policy"]
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        returned = []
        for _ in range(3):
            reply = c.chat.completions.create(model="policy", messages=messages, logprobs=True)
            choice = reply.choices[0]
            returned.append(choice.model_extra["token_ids"])
            assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
                log.calls[-1].sampler_logprobs.tolist(), abs=1e-6)
            messages += [choice.message, {"role": "user", "content": "And then?"}]
        c.completions.create(model="policy", prompt="What is", max_tokens=2)   # another conversation
    traj, chain = trajectory(log.calls, group=0)
    assert [len(x) for x in chains(log.calls)] == [3, 1] and len(chain) == 3
    model = [s.token_ids.tolist() for s in traj.segments if s.trained]
    assert model == returned                                  # no re-tokenisation of the model's text
    # Between the turns: the template's end of turn (when the turn was cut), the user's message, the next prompt.
    tok = policy.tokenizer
    between = [tok.decode(s.token_ids) for s in traj.segments if not s.trained]
    assert all(b.endswith("<|user|>And then?<|end|><|assistant|>") for b in between), between
    assert traj.prompt_ids == tuple(tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True,
                                                            return_dict=False))
    assert torch.equal(traj.loss_mask(), torch.cat([torch.full((len(s.token_ids),), float(s.trained))
                                                    for s in traj.segments]))


def test_a_request_for_other_sampling_settings_is_refused_and_recorded(policy) -> None:
    endpoint = Endpoint(NativeEngine(policy))
    with endpoint, endpoint.serving(SamplingParams(max_new_tokens=4, top_p=0.9)):
        log = endpoint.open_episode(key=1)
        c = client(endpoint, log.token)
        messages = [{"role": "user", "content": "Hi"}]
        with pytest.raises(openai.BadRequestError, match="temperature=0.2 was asked, and this run samples with "
                                                         "temperature=1.0"):
            c.chat.completions.create(model="policy", messages=messages, temperature=0.2)
        with pytest.raises(openai.BadRequestError, match="presence_penalty=0.5 changes the sampling distribution"):
            c.chat.completions.create(model="policy", messages=messages, presence_penalty=0.5)
        # The run's own values, max_tokens and stop are accepted (a cut keeps the tokens before it exact).
        reply = c.chat.completions.create(model="policy", messages=messages, temperature=1.0, top_p=0.9, max_tokens=2)
        assert len(reply.choices[0].model_extra["token_ids"]) <= 2
        with pytest.raises(openai.AuthenticationError, match="unknown API key"):
            client(endpoint, "made-up").chat.completions.create(model="policy", messages=messages)
        endpoint.close_episode(log)
        with pytest.raises(openai.ConflictError, match="this episode has ended"):
            c.chat.completions.create(model="policy", messages=messages)
    assert len(log.refusals) == 2 and len(log.calls) == 1


TOOLS = [{"type": "function", "function": {"name": "count", "description": "Count characters.", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]


def test_tool_calls_are_read_in_the_models_format_and_their_results_join_the_context() -> None:
    def script(context: str) -> str:
        if "<tool_response>" not in context:
            return 'Let me count.<tool_call>{"name": "count", "arguments": {"text": "abc"}}</tool_call>'
        return "It has " + context.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]

    endpoint = Endpoint(Scripted(script), chat_template="never")
    with endpoint, endpoint.serving(SamplingParams(max_new_tokens=120)):
        log = endpoint.open_episode(key=3)
        c = client(endpoint, log.token)
        messages = [{"role": "user", "content": "count abc"}]
        first = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0]
        assert first.finish_reason == "tool_calls" and first.message.content == "Let me count."
        (call,) = first.message.tool_calls
        assert call.function.name == "count" and json.loads(call.function.arguments) == {"text": "abc"}
        messages += [first.message, {"role": "tool", "tool_call_id": call.id, "content": "3"}]
        second = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0]
        assert second.finish_reason == "stop" and second.message.content == "It has 3"
    traj, chain = trajectory(log.calls, group=0)
    tok = build_char_tokenizer()
    assert len(chain) == 2
    assert [(s.role, tok.decode(s.token_ids)) for s in traj.segments] == [
        ("model", 'Let me count.<tool_call>{"name": "count", "arguments": {"text": "abc"}}</tool_call><eos>'),
        ("environment", "<tool_response>3</tool_response>"),
        ("model", "It has 3<eos>"),
    ]



def test_a_streamed_request_gets_the_whole_turn_as_server_sent_events() -> None:
    def script(context: str) -> str:
        if "<tool_response>" not in context:
            return 'Let me count.<tool_call>{"name": "count", "arguments": {"text": "abc"}}</tool_call>'
        return "It has 3"

    endpoint = Endpoint(Scripted(script), chat_template="never")
    with endpoint, endpoint.serving(SamplingParams(max_new_tokens=120)):
        log = endpoint.open_episode(key=3)
        c = client(endpoint, log.token)
        messages = [{"role": "user", "content": "count abc"}]
        chunks = list(c.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True,
                                                stream_options={"include_usage": True}))
        # the turn in one chunk (its token ids with it), the finish reason, the usage
        assert [len(ch.choices) for ch in chunks] == [1, 1, 0]
        delta = chunks[0].choices[0].delta
        assert delta.content == "Let me count." and chunks[1].choices[0].finish_reason == "tool_calls"
        (call,) = delta.tool_calls
        assert call.index == 0 and call.function.name == "count" and json.loads(call.function.arguments) == {
            "text": "abc"}
        assert chunks[0].choices[0].model_extra["token_ids"] == log.calls[0].token_ids.tolist()
        assert chunks[2].usage.completion_tokens == len(log.calls[0].token_ids)
        # The streamed answer continues its conversation like a whole one: the next call extends its tokens.
        messages += [{"role": "assistant", "content": delta.content, "tool_calls": [
            {"id": call.id, "type": "function", "function": call.function.model_dump()}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "3"}]
        text = [ch.choices[0].text for ch in c.completions.create(model="policy", prompt="<tool_response>",
                                                                    stream=True)]
        second = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0]
    assert text == ["It has 3", ""] and second.message.content == "It has 3"
    traj, chain = trajectory(log.calls, group=0)
    assert len(chain) == 2 and traj.segments[1].role == "environment" and len(log.calls) == 3


@pytest.mark.slow
def test_reinforge_serve_answers_an_openai_client(tmp_path: Path, micro_overrides: list[str]) -> None:
    from reinforge.cli import build_config
    from reinforge.jobs.train import run

    out = tmp_path / "run"
    run(build_config([*micro_overrides, "sft.steps=0", "train.steps=1", f"output_dir={out}"], None))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                     os.environ.get("PYTHONPATH")]))}
    # The server starts as from a terminal, SIGINT at its default (so Ctrl-C stops it), however the suite was
    # started: a suite launched in the background inherits SIGINT ignored, which exec keeps for the child.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server = subprocess.Popen([sys.executable, "-m", "reinforge.cli", "serve", str(out)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        # the first line that names the URL (a torch built for CUDA warns first on a machine without one)
        seen = []
        while (line := server.stdout.readline()) and len(seen) < 50:
            seen.append(line)
            if url := re.search(r"serving the policy at (http://127\.0\.0\.1:\d+/v1)", line):
                break
        assert url, "".join(seen) + (server.stdout.read() if server.poll() is not None else "")
        c = openai.OpenAI(base_url=url.group(1), api_key="anything", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["policy"]
        greedy = [c.completions.create(model="policy", prompt="12+7=", temperature=0, max_tokens=3).choices[0]
                  for _ in range(2)]
        assert greedy[0].text == greedy[1].text and len(greedy[0].model_extra["token_ids"]) <= 3
        chat = c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1+1="}], max_tokens=2)
        assert chat.choices[0].message.role == "assistant"
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0


def test_serve_options_are_checked() -> None:
    from reinforge.errors import ConfigError
    from reinforge.serve.run import serve_options

    assert serve_options(["port=8123", "step=2"]) == {"port": 8123, "step": 2}
    with pytest.raises(ConfigError, match=r"reinforge serve takes port=N .*; got 'host=0.0.0.0'"):
        serve_options(["host=0.0.0.0"])


def test_a_groups_episodes_share_one_prompt_the_rest_as_context() -> None:
    from reinforge.rollout.trajectory import Segment, Trajectory
    from reinforge.serve.records import share_prompt

    def made(prompt, tokens):
        segments = (Segment.sampled(torch.tensor(tokens), torch.zeros(len(tokens)), 3),) if tokens else ()
        return Trajectory(prompt_ids=tuple(prompt), segments=segments, truncated=False, group=0)

    # Two openings that differ after two tokens, and an episode that failed before its first call.
    out = share_prompt([made([1, 2, 3], [7]), made([1, 2, 4, 5], [8, 9]), made([], [])])
    assert [t.prompt_ids for t in out] == [(1, 2)] * 3
    assert [[(s.role, s.token_ids.tolist()) for s in t.segments] for t in out] == [
        [("environment", [3]), ("model", [7])], [("environment", [4, 5]), ("model", [8, 9])], []]
