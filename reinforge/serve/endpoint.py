"""The policy as an OpenAI-compatible service on loopback: what agents and evaluation harnesses call.

Routes (JSON over HTTP, on 127.0.0.1 only):

- `GET  /v1/models`: the one model served;
- `POST /v1/chat/completions`: messages (and `tools`) rendered by the model's chat template, the turn's
  tool calls returned as `tool_calls` in the family's format (reinforge/serve/chat.py);
- `POST /v1/completions`: a text prompt, or a list of token ids;
- `POST /v1/generate`: tokens in, tokens out: `{"input_ids": [...], "max_tokens", "n", "stop"}` ->
  `{"choices": [{"output_ids", "logprobs", "finish_reason"}], "policy_version"}`.

Every choice also carries `token_ids` (and, with `logprobs: true`, the sampler's log-probs). With
`"stream": true` a chat or text completion is sent as server-sent events, the whole turn in one chunk
(reinforge/serve/http.py).

Episodes. During training each episode gets its own API key (`open_episode`); every choice returned to it
is recorded against it as a `Call` (reinforge/serve/records.py): the exact prompt tokens, the sampled
tokens, their sampler log-probs and policy versions, so the trajectory the learner trains on is what was
sampled. Requests carry the run's sampling settings: one that asks for another temperature, top-p,
top-k, min-p, a penalty or a logit bias is refused (HTTP 400 saying why) and the refusal is recorded, which
fails its episode. `max_tokens` and `stop` are applied by cutting the sampled tokens where they say (the
tokens before a cut are distributed exactly as if sampling had stopped there). A key the endpoint did not
issue is refused, as is any request of an episode that has ended.

`free_sampling` (`reinforge serve`, no training): any key, nothing recorded, and a request's temperature
(0: greedy), top-p and max_tokens are used as asked.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from reinforge.agents.render import Renderer
from reinforge.agents.rollout import turn_decoder
from reinforge.agents.tools import TOOL_CALL_MARKERS
from reinforge.rollout.base import SamplingParams
from reinforge.serve.chat import ChatThread, assistant_message, chat_prompt, normal
from reinforge.serve.http import error as _error
from reinforge.serve.http import server
from reinforge.serve.records import Call, EpisodeLog
from reinforge.serve.sampler import Sample, Sampler

HOST = "127.0.0.1"   # never anything else: the endpoint serves the policy to this machine only


class Refused(ValueError):
    """A request the endpoint will not sample (HTTP 400, the message says why); recorded as the episode's
    failure."""


class CallLimit(Refused):
    """A request past the episode's max_calls (HTTP 400, code 'call_limit'): the episode stops there
    (stop reason max_turns), it does not fail for it."""

    code, stop_reason = "call_limit", "max_turns"


class ContextLimit(CallLimit):
    """An episode's request whose prompt fills the model's positions (HTTP 400, code 'context_length_exceeded',
    OpenAI's): the episode stops there (stop reason max_model_tokens: no room is left for the model's tokens),
    it does not fail for it. Its calls so far are trained on, with the reward its agent gives; the in-process
    rollout would have gone on past the positions instead, and such an episode (a long tool error after a
    long turn) is one the reward scores 0 either way, so dropping it would lose exactly the signal against
    what led there."""

    code, stop_reason = "context_length_exceeded", "max_model_tokens"


class Endpoint:
    """The HTTP endpoint over a rollout engine (see the module docstring). `start` binds 127.0.0.1:`port`
    (0: a free port), `close` stops it; `serving(params, version)` lends it the engine for a while."""

    def __init__(self, engine: Any, model_name: str = "policy", chat_template: str = "auto",
                 tool_parser: str = "hermes", free_sampling: bool = False, port: int = 0, slots: int = 16,
                 default_params: SamplingParams | None = None):
        self.engine, self.model_name = engine, model_name
        self.tokenizer = engine.policy.tokenizer
        self.eos_ids = list(engine.policy.eos_token_ids)
        self.chat_template, self.parser = chat_template, tool_parser
        self.free_sampling, self.port, self.slots = free_sampling, port, slots
        self.default_params = default_params or SamplingParams()
        self.decode = turn_decoder(self.tokenizer, TOOL_CALL_MARKERS.get(tool_parser, ()))
        config = getattr(engine.policy.model, "config", None)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.episodes: dict[str, EpisodeLog] = {}
        self.params: SamplingParams | None = None
        self.version = 0
        self._sampler: Sampler | None = None
        self._free: dict[SamplingParams, Sampler] = {}
        self._lock = threading.Lock()
        self._renderers: dict[str, Renderer] = {}
        self._server: Any = None
        self.latencies: list[float] = []

    # ---------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        """The base_url an OpenAI client takes."""
        return f"http://{HOST}:{self.port}/v1"

    def start(self) -> Endpoint:
        self._server = server((HOST, self.port), self.handle)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                         name="reinforge-endpoint", daemon=True).start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for sampler in self._free.values():
            sampler.close()
        self._free.clear()

    def __enter__(self) -> Endpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def serving(self, params: SamplingParams, version: int = 0,
                generator: torch.Generator | None = None) -> Iterator[Sampler]:
        """The engine samples this endpoint's requests with `params` (the run's) and weights `version` for the
        duration of the block."""
        self.params, self.version = params, version
        self._sampler = Sampler(self.engine, params, version, self.slots, generator).start()
        try:
            yield self._sampler
        finally:
            sampler, self._sampler = self._sampler, None
            sampler.close()

    def open_episode(self, key: int, max_calls: int | None = None) -> EpisodeLog:
        log = EpisodeLog(token=f"ep-{secrets.token_hex(12)}", key=key, max_calls=max_calls)
        with self._lock:
            self.episodes[log.token] = log
        return log

    def close_episode(self, log: EpisodeLog) -> None:
        with log.lock:
            log.closed = True       # kept, so that its later requests are told it ended (the endpoint lives a batch)
        sampler = self._sampler
        if sampler is not None:
            sampler.forget(log.token)

    # ---------------------------------------------------------------- routes

    def handle(self, method: str, path: str, key: str | None, body: dict) -> tuple[int, dict]:
        """One request: (HTTP status, JSON body). Used by the HTTP handler, callable directly."""
        started = time.perf_counter()
        if path.startswith("/e/"):                 # the episode in the base_url instead of the API key
            _, _, key, path = path.split("/", 3)
            path = "/" + path
        path = path.rstrip("/")
        if method == "GET" and path in ("/v1/models", "/models"):
            return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                     "owned_by": "reinforge"}]}
        if method == "GET" and path == "/health":
            return 200, {"status": "ok", "policy_version": self.version}
        routes = {"/v1/chat/completions": self._chat, "/v1/completions": self._completions,
                  "/v1/generate": self._generate}
        if method != "POST" or path not in routes:
            return 404, _error(f"no route {method} {path}: this endpoint serves GET /v1/models, POST "
                               "/v1/chat/completions, /v1/completions and /v1/generate", "not_found")
        log = None
        if not self.free_sampling:
            log = self.episodes.get(key or "")
            if log is None:
                return 401, _error("unknown API key: each episode's client carries the key the run gave it",
                                   "invalid_api_key")
            if log.closed:
                return 409, _error("this episode has ended (it returned or ran past its timeout)", "episode_ended")
        try:
            response, calls = routes[path](body, log)
        except CallLimit as err:
            return 400, _error(str(err), err.code)
        except Refused as err:
            if log is not None:
                log.refuse(str(err))
            return 400, _error(str(err), "invalid_request_error")
        except (ValueError, TypeError, KeyError) as err:
            return 400, _error(f"bad request: {type(err).__name__}: {err}", "invalid_request_error")
        except RuntimeError as err:
            return 503, _error(str(err), "unavailable")
        latency = time.perf_counter() - started
        calls = [replace(c, latency_s=latency) for c in calls]
        with self._lock:
            self.latencies.append(latency)
        if log is not None:
            log.record(calls)
        return 200, response

    # ---------------------------------------------------------------- sampling

    def _settings(self, body: dict) -> tuple[SamplingParams, int]:
        """The sampling params a request is drawn with and the number of tokens it may keep."""
        asked_max = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked_max is not None and (not isinstance(asked_max, int) or asked_max < 1):
            raise Refused(f"max_tokens must be a positive integer, got {asked_max!r}")
        if body.get("stream") not in (None, False, True):
            raise Refused(f"stream must be true or false, got {body['stream']!r}")
        if body.get("echo"):
            raise Refused("echo=true is not supported by this endpoint")
        for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
            if body.get(name) is not None and float(body[name]) != neutral:
                raise Refused(f"{name}={body[name]} changes the sampling distribution; this endpoint samples the "
                              "policy as it is: leave it out")
        response_format = body.get("response_format")
        if response_format and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
            raise Refused(f"response_format={response_format!r} would constrain decoding, which this endpoint does "
                          "not do: leave it out")
        if body.get("logit_bias"):
            raise Refused("logit_bias changes the sampling distribution; this endpoint samples the policy as it is")
        if self.free_sampling:
            temperature = body.get("temperature")
            base = self.default_params
            params = replace(base, greedy=temperature == 0 or (temperature is None and base.greedy),
                             temperature=float(temperature) if temperature else base.temperature,
                             top_p=float(body.get("top_p") or base.top_p),
                             max_new_tokens=int(asked_max or base.max_new_tokens))
            return params, params.max_new_tokens
        params = self.params
        if params is None:
            raise RuntimeError("the endpoint is not sampling now (no episodes are running)")
        ours = {"temperature": 0.0 if params.greedy else params.temperature, "top_p": params.top_p,
                "top_k": params.top_k, "min_p": params.min_p}
        for name, value in ours.items():
            asked = body.get(name)
            if asked is None or (name == "top_k" and asked in (0, -1) and value == 0):
                continue
            if not isinstance(asked, int | float) or not math.isclose(float(asked), float(value), abs_tol=1e-9):
                raise Refused(f"{name}={asked} was asked, and this run samples with {name}={value}: an episode's "
                              f"tokens are drawn with the run's settings (rollout.{name}); leave {name} out of the "
                              "request or set it to the run's value")
        return params, min(int(asked_max or params.max_new_tokens), params.max_new_tokens)

    def _draw(self, prompt_ids: list[int], n: int, params: SamplingParams, log: EpisodeLog | None) -> list[Sample]:
        if not isinstance(n, int) or not 1 <= n <= 64:
            raise Refused(f"n must be an integer from 1 to 64, got {n!r}")
        if not prompt_ids:
            raise Refused("the prompt is empty")
        if self.max_positions is not None and len(prompt_ids) >= self.max_positions:
            message = f"the prompt has {len(prompt_ids)} tokens, the model {self.max_positions} positions"
            if log is None:
                raise Refused(message)
            log.end(ContextLimit.stop_reason)
            raise ContextLimit(f"{message}: this episode's context is full")
        if log is not None:
            with log.lock:
                if log.max_calls is not None and log.requests >= log.max_calls:
                    log.limit = log.limit or CallLimit.stop_reason
                    raise CallLimit(f"this episode has made its {log.max_calls} calls (rollout.max_turns)")
            return self._sampler_now().sample(prompt_ids, n, log.next_key(), log.token)
        return self._free_sampler(params).sample(prompt_ids, n, secrets.randbits(62))

    def _sampler_now(self) -> Sampler:
        sampler = self._sampler
        if sampler is None:
            raise RuntimeError("the endpoint is not sampling now (no episodes are running)")
        return sampler

    def _free_sampler(self, params: SamplingParams) -> Sampler:
        with self._lock:
            if params not in self._free:
                if len(self._free) >= 8:       # settings rarely vary; keep the sessions bounded
                    self._free.pop(next(iter(self._free))).close()
                self._free[params] = Sampler(self.engine, params, self.version, self.slots).start()
            return self._free[params]

    def _cut(self, sample: Sample, keep: int, stop: list[str]) -> tuple[torch.Tensor, str, bool, bool]:
        """The sample's tokens kept (at most `keep`, through the token that completes a stop string), their
        text (the stop string and what follows removed), whether it was cut at `keep` or ran out, and
        whether a stop string ended it."""
        ids = sample.token_ids[:keep]
        cut_at_length = len(sample.token_ids) > keep or (sample.truncated and len(ids) == len(sample.token_ids))
        text = self.decode(ids)
        if stop and any(s in text for s in stop):
            for k in range(1, len(ids) + 1):
                part = self.decode(ids[:k])
                found = [part.index(s) for s in stop if s in part]
                if found:
                    return ids[:k], part[: min(found)], False, True
        return ids, text, cut_at_length, False

    def _record(self, prompt_ids: list[int], sample: Sample, ids: torch.Tensor, truncated: bool, route: str,
                messages: tuple = ()) -> Call:
        n = len(ids)
        return Call(tuple(prompt_ids), ids.clone(), sample.sampler_logprobs[:n].clone(), sample.versions[:n].clone(),
                    truncated, route, 0.0, messages)

    def _logprobs(self, ids: torch.Tensor, logprobs: torch.Tensor) -> list[dict]:
        return [{"token": self.tokenizer.decode([t]), "logprob": float(lp),
                 "bytes": list(self.tokenizer.decode([t]).encode()), "top_logprobs": []}
                for t, lp in zip(ids.tolist(), logprobs.tolist(), strict=True)]

    def _renderer(self, tools: list[dict] | None) -> tuple[Renderer, str]:
        key = json.dumps(tools, sort_keys=True) if tools else ""
        with self._lock:
            if key not in self._renderers:
                self._renderers[key] = Renderer(self.tokenizer, self.chat_template, tools or None, self.eos_ids)
            return self._renderers[key], key

    # ---------------------------------------------------------------- the routes

    def _chat(self, body: dict, log: EpisodeLog | None) -> tuple[dict, list[Call]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                    for m in messages):
            raise Refused("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
        tools = body.get("tools") or None
        if body.get("tool_choice") not in (None, "auto", "none"):
            raise Refused(f"tool_choice={body['tool_choice']!r} would constrain decoding, which this endpoint does "
                          "not do: use 'auto' or leave it out")
        params, keep = self._settings(body)
        stop = _stops(body.get("stop"))
        renderer, tools_key = self._renderer(tools)
        prompt_ids, rendered = chat_prompt(renderer, log.threads if log is not None else [], messages, tools_key)
        samples = self._draw(prompt_ids, body.get("n", 1), params, log)
        choices, calls, threads = [], [], []
        for j, sample in enumerate(samples):
            ids, text, cut, _ = self._cut(sample, keep, stop)
            message, finish = assistant_message(text, bool(tools) and body.get("tool_choice") != "none", self.parser)
            finish = "length" if cut else finish
            turn = {"role": "assistant", "content": text}
            calls.append(self._record(prompt_ids, sample, ids, cut, "chat", tuple(rendered) + (turn,)))
            threads.append(ChatThread([normal(m) for m in messages] + [normal(message)], rendered + [turn],
                                      prompt_ids + ids.tolist(), ids.tolist(), tools_key))
            choice = {"index": j, "message": message, "finish_reason": finish, "token_ids": ids.tolist(),
                      "logprobs": None}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": self._logprobs(ids, calls[-1].sampler_logprobs)}
            choices.append(choice)
        if log is not None:
            with log.lock:
                log.threads.extend(threads)
        return _response("chat.completion", self.model_name, choices, len(prompt_ids), calls,
                         prompt_token_ids=prompt_ids), calls

    def _completions(self, body: dict, log: EpisodeLog | None) -> tuple[dict, list[Call]]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        params, keep = self._settings(body)
        stop = _stops(body.get("stop"))
        text_prompt = None
        if isinstance(prompt, str):
            text_prompt = prompt
            prompt_ids = None
            for text, ids in sorted(log.texts if log is not None else [], key=lambda t: -len(t[0])):
                if prompt.startswith(text):      # continues an earlier call: its tokens, then the new text's
                    prompt_ids = ids + _encode(self.tokenizer, prompt[len(text):])
                    break
            if prompt_ids is None:
                prompt_ids = _encode(self.tokenizer, prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise Refused("prompt must be a string or a list of token ids (one prompt per request)")
        samples = self._draw(prompt_ids, body.get("n", 1), params, log)
        choices, calls = [], []
        for j, sample in enumerate(samples):
            ids, text, cut, _ = self._cut(sample, keep, stop)
            calls.append(self._record(prompt_ids, sample, ids, cut, "completions"))
            if log is not None and text_prompt is not None:
                with log.lock:
                    log.texts.append((text_prompt + self.tokenizer.decode(ids.tolist(), skip_special_tokens=False),
                                      prompt_ids + ids.tolist()))
            choice = {"index": j, "text": text, "finish_reason": "length" if cut else "stop",
                      "token_ids": ids.tolist(), "logprobs": None}
            if body.get("logprobs") is not None and body.get("logprobs") is not False:
                choice["logprobs"] = {"tokens": [self.tokenizer.decode([t]) for t in ids.tolist()],
                                      "token_logprobs": calls[-1].sampler_logprobs.tolist(),
                                      "top_logprobs": None, "text_offset": None}
            choices.append(choice)
        return _response("text_completion", self.model_name, choices, len(prompt_ids), calls,
                         prompt_token_ids=prompt_ids), calls

    def _generate(self, body: dict, log: EpisodeLog | None) -> tuple[dict, list[Call]]:
        prompt_ids = body.get("input_ids")
        if not isinstance(prompt_ids, list) or not all(isinstance(t, int) for t in prompt_ids):
            raise Refused("input_ids must be a list of token ids")
        params, keep = self._settings(body)
        stop = _stops(body.get("stop"))
        samples = self._draw(prompt_ids, body.get("n", 1), params, log)
        choices, calls = [], []
        for j, sample in enumerate(samples):
            ids, _, cut, _ = self._cut(sample, keep, stop)
            calls.append(self._record(prompt_ids, sample, ids, cut, "generate"))
            choices.append({"index": j, "output_ids": ids.tolist(), "logprobs": calls[-1].sampler_logprobs.tolist(),
                            "versions": calls[-1].versions.tolist(), "finish_reason": "length" if cut else "stop"})
        return {"object": "generation", "model": self.model_name, "choices": choices,
                "policy_version": self.version}, calls


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise Refused(f"stop must be a string or a list of strings, got {stop!r}")


def _response(obj: str, model: str, choices: list[dict], prompt_tokens: int, calls: list[Call], **extra: Any) -> dict:
    completion = sum(len(c.token_ids) for c in calls)
    return {"id": f"{'chatcmpl' if obj == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}", "object": obj,
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}, **extra}
