"""rollout.engine=vllm: vLLM's sampler log-probs against the learner's, weights after an update (the
weight-sync probe), RL runs through it, and the combinations it refuses.

These need vLLM (the environment of `make vllm-env`; `make test-vllm` runs them there). Where vLLM is not
installed they are skipped, except the ones that check what happens without it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from reinforge.config import build_config
from reinforge.errors import ConfigError, RunStopped
from reinforge.models import load_policy
from reinforge.rollout import SamplingParams
from reinforge.rollout.sampling import filter_logits
from reinforge.rollout.weight_sync import learner_logprobs, probe_ids, total_variation

# vLLM needs transformers<5.20, so it lives in its own venv: in the main suite these skip, and CI runs them
# there right after it (.ci/run: make test-vllm).
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here: `make test-vllm` runs these "
                                                     "in .venv-vllm (make vllm-env)")

# Heads of 32 (64 wide, 2 heads), the size vLLM's CPU attention runs as it is; narrower ones are served padded.
# Memory 0.1, the default: vLLM's CPU backend takes the share of the first CPU's NUMA node, less this process's
# own ~0.7 GB, for its KV cache; 0.05 of a machine whose node 0 holds 12 of its 24 GB left nothing.
VLLM_MODEL = ["model.hidden_size=64", "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=128",
              "rollout.engine=vllm", "rollout.vllm_gpu_memory_utilization=0.1"]
VARIED = ["reward.functions=[{name: verifier}, {name: format, params: {pattern: '1', mode: search}}]",
          "curation.filters=[]", "rollout.max_new_tokens=6"]


def _lines(path: Path, name: str) -> list[dict]:
    file = path / name
    return [json.loads(x) for x in file.read_text().splitlines()] if file.exists() else []


@pytest.fixture(scope="module")
def engine():
    from reinforge.rollout.vllm_engine import VLLMEngine

    cfg = build_config([*VLLM_MODEL, "model.num_layers=2"])
    policy = load_policy(cfg.model, seed=0)
    eng = VLLMEngine(policy, gpu_memory_utilization=0.1)
    yield eng
    eng.close()


def _learner_sampler_logprobs(policy, rollout, params: SamplingParams) -> torch.Tensor:
    """[N, T] the log-prob of each sampled token under softmax(filter(logits / T)) of the learner's forward."""
    out = torch.zeros_like(rollout.sampler_logprobs)
    for r, prompt in enumerate(rollout.prompt_ids):
        n = int(rollout.completion_mask[r].sum())
        ids = torch.tensor([*prompt, *rollout.completion_ids[r, :n].tolist()])[None]
        with torch.no_grad():
            logits = policy.model(input_ids=ids).logits[0, len(prompt) - 1: len(prompt) - 1 + n].float()
        scores = filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p)
        out[r, :n] = torch.log_softmax(scores, dim=-1).gather(1, ids[0, len(prompt):, None]).squeeze(1)
    return out


@needs_vllm
@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=5),
                                      dict(temperature=1.0, min_p=0.05)], ids=["top_p", "top_k", "min_p"])
def test_sampler_logprobs_are_the_learners(engine, sampling):
    params = SamplingParams(max_new_tokens=8, **sampling)
    rollout = engine.generate(["12+7=", "3*4=", "40-1="], 4, params, generator=torch.Generator().manual_seed(1))
    assert rollout.completion_ids.shape[0] == 12 and rollout.completion_mask.sum() > 12
    learner = _learner_sampler_logprobs(engine.policy, rollout, params)
    mask = rollout.completion_mask.bool()
    assert torch.all(torch.isfinite(rollout.sampler_logprobs[mask]))
    assert (rollout.sampler_logprobs - learner)[mask].abs().max() < 1e-4
    # A row that ends before max_new_tokens ends with eos, and is not truncated.
    eos = set(engine.policy.eos_token_ids)
    for r in range(12):
        n = int(rollout.completion_mask[r].sum())
        assert bool(rollout.truncated[r]) == (int(rollout.completion_ids[r, n - 1]) not in eos)
    # The same generator state gives the same samples.
    again = engine.generate(["12+7=", "3*4=", "40-1="], 4, params, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again.completion_ids, rollout.completion_ids)


@needs_vllm
def test_greedy_is_the_learners_argmax(engine):
    params = SamplingParams(max_new_tokens=6, greedy=True)
    rollout = engine.generate(["5+5=", "9-2="], 1, params)
    learner = _learner_sampler_logprobs(engine.policy, rollout, SamplingParams(temperature=1.0))
    mask = rollout.completion_mask.bool()
    assert (rollout.sampler_logprobs - learner)[mask].abs().max() < 1e-4
    for r, prompt in enumerate(rollout.prompt_ids):
        ids = torch.tensor([*prompt, *rollout.completion_ids[r, :-1].tolist()])[None]
        with torch.no_grad():
            argmax = engine.policy.model(input_ids=ids).logits[0, len(prompt) - 1:].argmax(-1)
        n = int(mask[r].sum())
        assert rollout.completion_ids[r, :n].tolist() == argmax[:n].tolist()


@needs_vllm
def test_weights_after_an_update_reach_vllm(engine):
    model = engine.policy.model
    ids = probe_ids(model.config.vocab_size)
    assert total_variation(engine.probe_logprobs(ids), learner_logprobs(model, ids)) < 1e-4
    with torch.no_grad():                       # an "update": every weight moved, the tied embedding included
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stale = total_variation(engine.probe_logprobs(ids), learner_logprobs(model, ids))
    assert stale > 1e-2                         # vLLM still holds the old weights: the probe sees it
    before = engine.publications
    engine.publish(model)
    assert engine.publications == before + 1
    assert total_variation(engine.probe_logprobs(ids), learner_logprobs(model, ids)) < 1e-4
    # generate publishes by itself when the tensors changed since (e.g. SFT before RL): once, then not again.
    # A fused AdamW step, as the learner's: it leaves the tensors' in-place version counters as they were.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model(input_ids=ids).logits.logsumexp(-1).mean().backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=0.9)
    rollout = engine.generate(["1+1="], 2, params)
    assert engine.publications == before + 2
    engine.generate(["1+1="], 2, params)
    assert engine.publications == before + 2
    assert total_variation(engine.probe_logprobs(ids), learner_logprobs(model, ids)) < 1e-4
    learner = _learner_sampler_logprobs(engine.policy, rollout, params)
    mask = rollout.completion_mask.bool()
    assert (rollout.sampler_logprobs - learner)[mask].abs().max() < 1e-4


@needs_vllm
def test_the_vllm_sampler_keys_each_group(engine):
    """A request's samples depend on its group key, not on which other requests share its vLLM call."""
    from reinforge.rollout.stream import GroupRequest
    from reinforge.rollout.vllm_stream import VLLMSampler

    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9)
    sampler = VLLMSampler(engine, params, group_size=3)
    try:
        sampler.publish(engine.policy.model, 1)
        sampler.submit([GroupRequest(0, "1+2=", key=11)])
        alone = sampler.get(timeout=120)
        sampler.submit([GroupRequest(1, "3+4=", key=5), GroupRequest(2, "1+2=", key=11),
                        GroupRequest(3, "1+2=", key=12)])
        together = {}
        while len(together) < 3:
            group = sampler.get(timeout=120)
            together[group.seq] = group
        assert sampler.probe(1, probe_ids(engine.vocab_size), timeout=10)[0].version == 1
    finally:
        sampler.close()
    assert alone.seq == 0 and torch.equal(alone.rollout.completion_ids, together[2].rollout.completion_ids)
    assert torch.equal(alone.rollout.sampler_logprobs, together[2].rollout.sampler_logprobs)
    assert not torch.equal(together[2].rollout.completion_ids, together[3].rollout.completion_ids)
    assert (together[2].versions[together[2].rollout.completion_mask.bool()] == 1).all()


@needs_vllm
def test_lora_hands_vllm_the_adapter_alone(tmp_path):
    """model.lora: vLLM holds the base weights and, after each update, the adapter as a LoRA request. Its
    outputs change with the adapter and match the learner's; the base weights are never sent again."""
    from reinforge.rollout.vllm_engine import VLLMEngine

    cfg = build_config([*VLLM_MODEL, "model.num_layers=2", "model.num_heads=4", "model.lora.r=4"])   # heads of 16
    policy = load_policy(cfg.model, seed=0)
    engine = VLLMEngine(policy, gpu_memory_utilization=0.1)
    try:
        model, ids = policy.model, probe_ids(policy.model.config.vocab_size)
        sent = []
        real = engine.llm.collective_rpc
        engine.llm.collective_rpc = lambda *a, **k: sent.append(a) or real(*a, **k)
        with torch.no_grad():                    # an "update" of the adapters alone (B starts at zero)
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(0.3 * torch.randn_like(p))
        assert total_variation(engine.probe_logprobs(ids), learner_logprobs(model, ids)) > 1e-2   # not yet sent
        engine.publish(model)
        assert total_variation(engine.probe_logprobs(ids), learner_logprobs(model, ids)) < 1e-4
        assert engine.lora_request is not None and not sent                                      # the adapter alone
        files = sorted(p.name for p in engine.adapter.directory.iterdir())
        assert files == ["adapter_config.json", "adapter_model.safetensors"]
        params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9)
        rollout = engine.generate(["1+2=", "3+4="], 2, params)
        learner = _learner_sampler_logprobs(policy, rollout, params)
        assert (rollout.sampler_logprobs - learner)[rollout.completion_mask.bool()].abs().max() < 1e-4
    finally:
        engine.close()


def _run(tmp_path, *extra):
    from reinforge.jobs.train import run

    cfg = build_config([*VLLM_MODEL, "model.num_layers=1", "sft.steps=0", "train.prompts_per_step=4",
                        "train.group_size=4", "train.micro_batch_size=8", "eval.num_prompts=6", "eval.num_samples=2",
                        *VARIED, *extra, f"output_dir={tmp_path}"])
    return run(cfg)


@needs_vllm
def test_rl_run_passes_the_probe_every_step(tmp_path):
    _run(tmp_path, "train.steps=3", "train.lr=1e-2", "rollout.top_p=0.9")
    rl = [x for x in _lines(tmp_path, "metrics.jsonl") if x.get("stage") == "rl"]
    assert [x["step"] for x in rl] == [1, 2, 3]
    assert all(0 <= x["sync/probe_tv"] < 1e-4 for x in rl)
    assert all(x["grad_norm"] > 0 for x in rl)      # the weights moved: the probe compared new weights
    assert all(x["mismatch_kl"] < 1e-4 for x in rl)
    assert not [a for a in _lines(tmp_path, "alerts.jsonl") if a["alert"] == "weight_sync"]


@needs_vllm
def test_a_skipped_publication_stops_the_run(tmp_path, monkeypatch):
    from reinforge.rollout.vllm_engine import VLLMEngine

    monkeypatch.setattr(VLLMEngine, "publish", lambda self, model=None: None)
    match = "vllm engine's next-token distributions on the probe differ"
    with pytest.raises(RunStopped, match=match):
        _run(tmp_path, "train.steps=3", "train.lr=1e-2")
    alerts = [a for a in _lines(tmp_path, "alerts.jsonl") if a["alert"] == "weight_sync"]
    assert len(alerts) == 1 and alerts[0]["step"] == 1 and match in alerts[0]["message"]
    assert not [x for x in _lines(tmp_path, "metrics.jsonl") if x.get("stage") == "rl"]


@needs_vllm
def test_the_tool_task_trains_through_vllm(tmp_path):
    """Multi-turn episodes (the agent rollout over vLLM's generate_ids, each turn from its whole context): a
    short cold start makes the micro model call the calculator, so every step has tool results in context."""
    _run(tmp_path, "task.name=multiply_tool", "sft.steps=100", "sft.batch_size=32", "sft.num_examples=3200",
         "sft.lr=1e-2", "rollout.max_new_tokens=24", "model.max_positions=160", "eval.num_prompts=2", "train.steps=2")
    rl = [x for x in _lines(tmp_path, "metrics.jsonl") if x.get("stage") == "rl"]
    assert [x["step"] for x in rl] == [1, 2]
    assert all(x["env/turns_mean"] > 1.0 and x["env/environment_tokens_mean"] > 0 for x in rl)
    assert all(0 <= x["sync/probe_tv"] < 1e-4 and x["mismatch_kl"] < 1e-4 for x in rl)


@needs_vllm
@pytest.mark.parametrize("lora", [[], ["model.lora.r=4", "train.lr=5e-2"]], ids=["full", "lora"])
def test_heads_below_vllms_cpu_size_are_served_padded(tmp_path, lora):
    """The built-in model's default heads (16 wide, below the 32 vLLM's CPU attention runs) are served padded
    to 32 (rollout/vllm_layout.py): the probe and the sampler's log-probs still match the learner's, with
    the full weights or a LoRA adapter handed over after every update."""
    _run(tmp_path, "model.num_heads=4", "model.num_kv_heads=2", "train.steps=2", "train.lr=1e-2", "rollout.top_p=0.9",
         *lora)
    rl = [x for x in _lines(tmp_path, "metrics.jsonl") if x.get("stage") == "rl"]
    assert [x["step"] for x in rl] == [1, 2]
    assert all(0 <= x["sync/probe_tv"] < 1e-4 and x["mismatch_kl"] < 1e-4 and x["grad_norm"] > 0 for x in rl)


@needs_vllm
def test_async_trains_through_vllm(tmp_path):
    """recipe=areal: groups streamed from the vLLM sampler thread while the learner trains; vLLM holds each
    published version (the probe waits for it), and staleness stays within train.max_staleness."""
    _run(tmp_path, "recipe=areal", "train.steps=4", "train.lr=1e-2", "rollout.top_p=0.9", "train.max_staleness=2")
    rl = [x for x in _lines(tmp_path, "metrics.jsonl") if x.get("stage") == "rl"]
    assert [x["step"] for x in rl] == [1, 2, 3, 4]
    assert all(0 <= x["sync/probe_tv"] < 1e-4 for x in rl)
    assert rl[0]["async/staleness_max"] == 0 and rl[0]["mismatch_kl"] < 1e-4     # the first batch: version 0
    assert max(x["async/staleness_max"] for x in rl) <= 2
    assert max(x["async/staleness_max"] for x in rl) >= 1                        # it did run ahead of the learner
    assert all(x["async/too_stale_total"] == 0 for x in rl)


@needs_vllm
def test_async_episodes_through_vllm_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="samples single-turn groups: episodes"):
        _run(tmp_path, "recipe=areal", "task.name=multiply_tool", "train.steps=1")


@pytest.fixture(scope="module")
def llama_bpe_dir(tmp_path_factory) -> Path:
    """A local Llama (head size 32) with a byte-level BPE tokenizer trained here and a chat template."""
    from conftest import CHAT_TEMPLATE, SPECIALS, byte_bpe
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [f"What is {a} + {b}? The answer is {a + b}. Be brief, think." for a in range(20) for b in range(5)]
    tok = PreTrainedTokenizerFast(tokenizer_object=byte_bpe(corpus, SPECIALS), pad_token="<pad>", eos_token="<|end|>",
                                  additional_special_tokens=SPECIALS[2:])
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id))
    path = tmp_path_factory.mktemp("llama_bpe_vllm")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@needs_vllm
def test_a_local_llama_folder_with_a_chat_template_trains_through_vllm(llama_bpe_dir, tmp_path):
    from reinforge.jobs.train import run

    cfg = build_config([f"model={llama_bpe_dir}", "rollout.engine=vllm", "rollout.vllm_gpu_memory_utilization=0.1",
                        "sft.enabled=false", "train.steps=2", "train.prompts_per_step=4", "train.group_size=4",
                        "train.lr=1e-2", "rollout.max_new_tokens=8", "rollout.top_p=0.9", "eval.num_prompts=4",
                        "eval.num_samples=2", *VARIED[:2], f"output_dir={tmp_path}"])
    run(cfg)
    rl = [x for x in _lines(tmp_path, "metrics.jsonl") if x.get("stage") == "rl"]
    assert [x["step"] for x in rl] == [1, 2]
    assert all(0 <= x["sync/probe_tv"] < 1e-4 and x["mismatch_kl"] < 1e-4 for x in rl)
    assert all(x["grad_norm"] > 0 for x in rl)


@needs_vllm
@pytest.mark.parametrize(("extra", "match"), [
    (["recipe=areal", "backend=ray"], "samples in a thread of this process over its one vLLM engine"),
    (["rollout.quantization=int8"], "rollout.quantization=int8 is built for the native engine only"),
    (["rollout.record_top_k=2"], "rollout.record_top_k needs rollout.engine=native"),
])
def test_unsupported_combinations_are_refused(extra, match):
    with pytest.raises(ConfigError, match=match):
        build_config([*VLLM_MODEL, *extra])


@needs_vllm
def test_refusals_at_engine_start(engine):
    from reinforge.rollout.vllm_engine import VLLMEngine

    with pytest.raises(ConfigError, match="rollout.engine=vllm applies min-p before top-p"):
        engine.sampling_params(SamplingParams(top_p=0.9, min_p=0.1), seed=0)
    cfg = build_config(["model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=1",   # head size 16
                        "model.moe.experts=2"])                                        # not paddable
    with pytest.raises(ConfigError, match=r"needs an attention head size in \[32, 64.*cannot be served padded"):
        VLLMEngine(load_policy(cfg.model, seed=0))


def test_engine_vllm_without_vllm_names_the_make_target(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        build_config(["rollout.engine=vllm"])
    assert "rollout.engine=vllm needs vLLM, which is not installed here: run `make vllm-env` and use " \
           ".venv-vllm/bin/reinforge (docs/engine.md)" in str(err.value)
