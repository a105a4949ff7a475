"""End to end on CUDA with the Triton backend and CUDA-graph decode: greedy tokens equal transformers' in
fp32 on tiny checkpoints of every family, and bf16 logits on a real-shape preset are as close to transformers' fp32
logits as transformers' own bf16 ones."""

from __future__ import annotations

import pytest
import torch
import transformers

from radixinfer import LLM, SamplingParams
from radixinfer.attention.triton_backend import TritonAttentionBackend
from tests.engine_helpers import FAMILIES, save_tiny_checkpoint
from tests.test_engine_equivalence import burst

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def hf_greedy_cuda(path, prompt, max_new_tokens):
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    )
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triton_backend_greedy_matches_transformers_fp32(family, tmp_path):
    path = save_tiny_checkpoint(family, tmp_path)
    llm = LLM(
        str(path), device="cuda", dtype="float32", block_size=16, num_blocks=256, max_batch_size=16
    )
    assert isinstance(llm.engine.runner.backend, TritonAttentionBackend)
    assert llm.engine.runner.graphs.decode, "decode should run through CUDA graphs on CUDA"
    prompts = burst(0) + burst(1)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for _ in range(2):  # the second burst runs on a warm cache (exact repeats, payload hits)
        outs = llm.generate(prompts, params)
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy_cuda(path, prompt, 8)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shared_prefix_decode_matches_transformers_fp32(family, tmp_path):
    """Seven prompts on one 200-token system prompt (an exact repeat among them): decode groups them and
    reads the prompt's blocks once per tile (the planner finds tiles), and greedy tokens still equal
    transformers'."""
    import random

    path = save_tiny_checkpoint(family, tmp_path)
    llm = LLM(
        str(path), device="cuda", dtype="float32", block_size=16, num_blocks=512, max_batch_size=16
    )
    planner = llm.engine.runner._planner
    tiles = []
    plan = planner.plan_shared_prefixes
    planner.plan_shared_prefixes = lambda *args: tiles.append(plan(*args)) or tiles[-1]
    rng = random.Random(5)
    system = [rng.randrange(1, 300) for _ in range(200)]
    prompts = [
        system + [rng.randrange(1, 300) for _ in range(rng.randrange(1, 9))] for _ in range(6)
    ]
    prompts.append(list(prompts[0]))
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert max(tiles) > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy_cuda(path, prompt, 8)


def test_bf16_logits_close_to_transformers_on_qwen25_05b(tmp_path):
    from radixinfer.models.presets import preset_config

    torch.manual_seed(0)
    config = preset_config("qwen2.5-0.5b")
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", num_blocks=512, max_batch_size=8)
    prompt = torch.randint(
        0, config.vocab_size, (300,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    runner = llm.engine.runner
    table = list(range(-(-len(prompt) // 16)))
    hidden = runner.prefill(
        prompt,
        list(range(len(prompt))),
        list(range(len(prompt))),
        [table],
        [len(prompt)],
        [len(prompt)],
    )
    ours = runner.logits(hidden)
    with torch.no_grad():
        ids = torch.tensor([prompt], device="cuda")
        hf_bf16 = hf(ids).logits[0]
        exact = hf.float()(ids).logits[
            0
        ]  # transformers in float32 on the same (bf16-valued) weights
    # two bf16 forwards that round differently differ by about as much as each differs from float32 (~1.8e-2
    # here), so each is measured against float32: ours must be as accurate as transformers' own bf16
    rel = lambda x: ((x.float() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert rel(ours) < min(1.05 * rel(hf_bf16), 2e-2), (
        f"{rel(ours):.3e}; transformers' bf16: {rel(hf_bf16):.3e}"
    )


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "min_p": 0.05},
        {"temperature": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.5},
        {"temperature": 0.8, "repetition_penalty": 1.2, "min_tokens": 6, "logit_bias": {5: 2.0}},
    ],
)
def test_steps_never_synchronise_the_stream(fields):
    """A burst of requests, several prefill chunks and decode steps, under torch's sync debug mode:
    no op on the engine's path makes the host wait for the stream (a step reads its tokens back
    by an event on pinned memory; anything else would idle the GPU while the host catches up).
    Requests asking for logprobs read back at once by design, so none here asks."""
    llm = LLM("tiny", device="cuda", max_batch_size=16, prefill_max_tokens=128)
    prompts = [[(7 * i + j) % 250 for j in range(40 + 9 * i)] for i in range(16)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, seed=1, **fields)
    llm.generate(prompts[:2], params)  # compile the kernels, capture the graphs
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = llm.generate(prompts, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 16
