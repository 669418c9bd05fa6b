"""`reinforge serve RUN_DIR`: a trained policy as an OpenAI-compatible endpoint, no training.

The endpoint of reinforge/serve/endpoint.py with nothing recorded (`free_sampling`): any API key, and a
request's own temperature (0: greedy), top-p and max_tokens, the run's rollout settings by default. So any
OpenAI-compatible evaluation harness can be pointed at a checkpoint: base_url http://127.0.0.1:PORT/v1,
model 'policy'.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from reinforge.errors import ConfigError
from reinforge.models import Policy
from reinforge.rollout import build_engine
from reinforge.rollout.base import SamplingParams
from reinforge.serve.agent import MODEL_NAME
from reinforge.serve.endpoint import Endpoint
from reinforge.settings import RolloutConfig

OPTIONS = {"port": "the port on 127.0.0.1 (default: a free one, printed)",
           "step": "the checkpoint to serve (default: the newest, else the run's final model)"}


def serve_options(arguments: list[str]) -> dict[str, int | None]:
    """`port=N step=N` from the command line; ConfigError naming what is wrong."""
    out: dict[str, int | None] = {"port": 0, "step": None}
    for argument in arguments:
        key, sep, value = argument.partition("=")
        if not sep or key not in OPTIONS:
            raise ConfigError(f"reinforge serve takes {', '.join(f'{k}=N ({v})' for k, v in OPTIONS.items())}; "
                              f"got {argument!r}")
        if not value.isdigit() or (key == "port" and int(value) > 65535):
            raise ConfigError(f"{key}={value!r}: give a whole number{' up to 65535' if key == 'port' else ''}")
        out[key] = int(value)
    return out


def serve_policy(policy: Policy, rollout: RolloutConfig, chat_template: str, port: int,
                 say: Callable[[str], None], stop: threading.Event | None = None) -> None:
    """Serve `policy` on 127.0.0.1:`port` (0: a free one) until `stop` is set or the process is interrupted;
    `say` gets the line with the address once it answers."""
    engine = build_engine(rollout, policy, chat_template)
    from reinforge.serve.setup import tool_parser

    endpoint = Endpoint(engine, MODEL_NAME, chat_template, tool_parser(policy, rollout), free_sampling=True,
                        port=port, default_params=SamplingParams.from_config(rollout))
    with endpoint:
        say(f"serving the policy at {endpoint.url} (OpenAI-compatible, model '{MODEL_NAME}'); Ctrl-C stops")
        (stop or threading.Event()).wait()
