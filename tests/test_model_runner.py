"""ModelRunner: decode steps equal the prefill's logits for the same positions (eager on CPU, CUDA graphs on
CUDA), whatever rows, padding and stale rows earlier batches left in the persistent decode buffers; the
incremental block-table rows; the sampler's host-side noise keys."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kernels.sampling import gumbel_from_keys
from radixinfer.attention import get_backend
from radixinfer.attention.triton_backend import TritonAttentionBackend
from radixinfer.engine.kv_store import KVStore
from radixinfer.engine.model_runner import ModelRunner
from radixinfer.engine.sampler import SamplingBatch, row_keys, seed_bits
from radixinfer.engine.step_buffers import BlockTableRows, pack_block_tables
from radixinfer.models import load_model
from tests import _triton_env  # noqa: I001  (first: without CUDA, Triton must start in interpreter mode)

BLOCK_SIZE = 16
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


def make_runner(
    device: str, max_batch_size: int = 4, num_blocks: int = 64, backend=None, **kwargs
) -> ModelRunner:
    model = load_model("tiny", device, dtype="float32", seed=0).model
    kv = KVStore(
        model.num_layers,
        num_blocks,
        BLOCK_SIZE,
        model.num_kv_heads,
        model.head_dim,
        torch.float32,
        torch.device(device),
    )
    return ModelRunner(
        model, kv, backend or get_backend(device), torch.device(device), max_batch_size, **kwargs
    )


def slots(table: list[int], positions) -> list[int]:
    return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def prefill(runner: ModelRunner, seqs: list[tuple[list[int], list[int], int]]) -> torch.Tensor:
    """One ragged prefill of positions ``0 .. end - 1`` of each ``(tokens, table, end)``; returns the logits of
    every computed position, sequences concatenated."""
    ids = [t for tokens, _, end in seqs for t in tokens[:end]]
    positions = [p for _, _, end in seqs for p in range(end)]
    slot_mapping = [s for _, table, end in seqs for s in slots(table, range(end))]
    ends = [end for _, _, end in seqs]
    hidden = runner.prefill(
        ids, positions, slot_mapping, [table for _, table, _ in seqs], ends, ends
    )
    return runner.logits(hidden)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_steps_equal_prefill_logits_whatever_the_rows(device):
    """Three sequences in shuffled blocks: a reference prefill of each whole prompt, then the same prompts
    prefilled short of their last tokens and decoded in batches that change size and order (rows move,
    shrink, leave stale rows behind, and on CUDA are padded up to a graph bucket)."""
    runner = make_runner(device)
    rng = random.Random(0)
    blocks = list(range(64))
    rng.shuffle(blocks)
    lengths = [40, 23, 61]  # tables of 3, 2 and 4 blocks
    prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]
    ref_tables = [[blocks.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lengths]
    ref = prefill(runner, [(p, t, len(p)) for p, t in zip(prompts, ref_tables)])
    starts = np.cumsum([0] + lengths)
    expected = [ref[starts[i] : starts[i + 1]] for i in range(3)]  # [len, vocab] per sequence

    tables = [[blocks.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lengths]
    done = [n - 6 for n in lengths]  # positions already in the cache
    prefill(runner, [(p, t, d) for p, t, d in zip(prompts, tables, done)])
    # Pass a fresh list per step, as the engine hands its live tables: rows must follow contents, not identity.
    for batch in ([0, 1, 2], [2, 0], [1], [1, 2, 0], [0, 2], [2, 1, 0]):
        logits = runner.decode(
            [prompts[i][done[i]] for i in batch],
            [done[i] for i in batch],
            [slots(tables[i], [done[i]])[0] for i in batch],
            [list(tables[i]) for i in batch],
            [done[i] + 1 for i in batch],
        )
        assert logits.shape == (len(batch), runner.model.vocab_size)
        for row, i in enumerate(batch):
            torch.testing.assert_close(logits[row], expected[i][done[i]], rtol=1e-4, atol=1e-4)
            done[i] += 1


@pytest.mark.parametrize("device", DEVICES)
def test_decode_reads_shared_prefixes_once_with_the_same_logits(device):
    """Four sequences whose tables share the 9 blocks of a 150-token prompt's first 144 positions (as the
    prefix cache lays them out), through the Triton backend (the interpreter on CPU, graphs on CUDA): the
    planner groups them, the decode logits equal those of the same sequences in unshared blocks, and the
    step's floor counts the shared positions once."""
    if device == "cpu" and not _triton_env.INTERPRETED:
        pytest.skip(
            "Triton kernels take CPU tensors only in the interpreter (this machine has CUDA)"
        )
    runner = make_runner(device, max_batch_size=4, num_blocks=128, backend=TritonAttentionBackend())
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(150)]
    seqs = [prompt + [rng.randrange(256) for _ in range(10 + i)] for i in range(4)]
    free = list(range(128))
    rng.shuffle(free)
    take = lambda n: [free.pop() for _ in range(n)]  # noqa: E731
    ref_tables = [take(-(-len(t) // BLOCK_SIZE)) for t in seqs]
    ref = prefill(runner, [(t, table, len(t)) for t, table in zip(seqs, ref_tables)])
    starts = np.cumsum([0] + [len(t) for t in seqs])
    shared = take(9)
    tables = [shared + take(-(-len(t) // BLOCK_SIZE) - 9) for t in seqs]
    done = [len(t) - 3 for t in seqs]
    prefill(runner, [(t, table, d) for t, table, d in zip(seqs, tables, done)])
    for _ in range(3):
        logits = runner.decode(
            [t[d] for t, d in zip(seqs, done)],
            done,
            [slots(table, [d])[0] for table, d in zip(tables, done)],
            tables,
            [d + 1 for d in done],
        )
        assert runner._decode_buffers.kv_starts[:4].tolist() == [144] * 4
        # the step's floor reads the 144 shared positions once, each sequence's own past them
        own = sum(d + 1 - 144 for d in done)
        assert runner.last_decode_read_bytes == (
            runner.weight_read_bytes + (144 + own) * runner.kv.bytes_per_position
        )
        for i, d in enumerate(done):
            torch.testing.assert_close(logits[i], ref[starts[i] + d], rtol=1e-4, atol=1e-4)
        done = [d + 1 for d in done]


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_passes_equal_whole_prompt_logits_whatever_the_split(device):
    """Prompts prefilled in two ragged passes that cut them at different points (the second pass over cached
    prefixes, with a new prompt joining), through the Triton backend (the interpreter on CPU, the token-bucket
    graphs on CUDA), give the logits of each whole prompt prefilled alone by the reference backend, and write
    no block outside the tables (the padding tokens of a bucket store nothing)."""
    if device == "cpu" and not _triton_env.INTERPRETED:
        pytest.skip(
            "Triton kernels take CPU tensors only in the interpreter (this machine has CUDA)"
        )
    runner = make_runner(
        device,
        num_blocks=32,
        backend=TritonAttentionBackend(),
        prefill_max_tokens=128,
        prefill_max_seqs=4,
    )
    assert bool(runner.graphs.prefill) == (device == "cuda")
    reference = make_runner(device, num_blocks=32, use_cuda_graphs=False)
    rng = random.Random(5)
    lengths = [40, 23, 61, 7]
    prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]
    free = list(range(32))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lengths]
    expected = [prefill(reference, [(p, t, len(p))]) for p, t in zip(prompts, tables)]
    k_before = runner.kv.k.clone()
    got = [[] for _ in prompts]
    for cuts in ({0: (0, 30), 1: (0, 23), 2: (0, 10)}, {0: (30, 40), 2: (10, 61), 3: (0, 7)}):
        seqs = sorted(cuts)
        ids = [t for i in seqs for t in prompts[i][cuts[i][0] : cuts[i][1]]]
        positions = [p for i in seqs for p in range(*cuts[i])]
        slot_mapping = [s for i in seqs for s in slots(tables[i], range(*cuts[i]))]
        hidden = runner.prefill(
            ids,
            positions,
            slot_mapping,
            [tables[i] for i in seqs],
            [cuts[i][1] for i in seqs],
            [cuts[i][1] - cuts[i][0] for i in seqs],
        )
        logits = runner.logits(hidden)
        starts = np.cumsum([0] + [cuts[i][1] - cuts[i][0] for i in seqs])
        for j, i in enumerate(seqs):
            got[i].append(logits[starts[j] : starts[j + 1]])
    for i in range(len(prompts)):
        torch.testing.assert_close(torch.cat(got[i]), expected[i], rtol=1e-4, atol=1e-4)
    written = (runner.kv.k != k_before).any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist()
    assert written == sorted(b for t in tables for b in t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_each_forward_computes_from_its_own_inputs_while_the_gpu_runs_behind():
    """The host fills the next forward's buffers at once, while this forward's upload may still wait on the
    stream behind earlier work (here a sleep kernel of tens of milliseconds): two prefills and two decodes
    launched back to back must each compute what it was launched with."""
    runner = make_runner("cuda")
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (30, 45)]
    tables = [[0, 1], [2, 3, 4]]
    expected = [prefill(runner, [(p, t, len(p))]) for p, t in zip(prompts, tables)]
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    prefilled = [prefill(runner, [(p, t, len(p))]) for p, t in zip(prompts, tables)]
    torch.cuda._sleep(100_000_000)
    decoded = [
        runner.decode([p[-1]], [len(p) - 1], slots(t, [len(p) - 1]), [t], [len(p)]).clone()
        for p, t in zip(prompts, tables)
    ]
    for i in range(2):
        torch.testing.assert_close(prefilled[i], expected[i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(decoded[i][0], expected[i][-1], rtol=1e-4, atol=1e-4)


def test_graphs_are_used_on_cuda_only():
    runner = make_runner("cpu")
    assert not runner.graphs.decode and not runner.graphs.prefill


@pytest.mark.parametrize("device", DEVICES)
def test_padded_rows_store_nothing(device):
    """A decode batch of one, padded on CUDA up to its graph bucket, writes only its own slot."""
    runner = make_runner(device, max_batch_size=8)
    prompt = list(range(1, 20))
    table = [5, 9]
    prefill(runner, [(prompt, table, 18)])
    k_before = runner.kv.k.clone()
    runner.decode([prompt[18]], [18], slots(table, [18]), [table], [19])
    changed = (
        (runner.kv.k != k_before).any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist()
    )  # blocks written
    assert changed == [9]


def reference_rows(tables: list[list[int]], width: int) -> np.ndarray:
    out = np.zeros((len(tables), width), dtype=np.int32)
    pack_block_tables(tables, out)
    return out


def test_block_table_rows_follow_every_kind_of_change():
    rows = BlockTableRows(np.zeros((5, 6), dtype=np.int32))
    a, b, c = [3, 1], [9, 8, 7], [4]
    assert rows.update([a, b, c]) == ([0, 1, 2], 3)
    assert rows.update([a, b, c]) == ([], 0)  # nothing changed: nothing rewritten
    a.append(2)  # growth by a block
    b[-1] = 11  # copy-on-write of the last block
    b[0] = 12  # a remap in the middle
    assert rows.update([a, b, c]) == ([0, 1], 3)
    np.testing.assert_array_equal(rows.rows[:3], reference_rows([a, b, c], 6))
    # rows move and shrink: stale entries past the end are zeroed, and count in the width sent
    assert rows.update([c, [], a]) == ([0, 1, 2], 3)
    np.testing.assert_array_equal(rows.rows[:3], reference_rows([c, [], a], 6))
    np.testing.assert_array_equal(rows.rows[3:], 0)  # rows past every batch were never written


def test_block_table_rows_told_which_rows_changed_compare_only_those():
    rows = BlockTableRows(np.zeros((4, 6), dtype=np.int32))
    a, b, c = [3, 1], [9, 8, 7], [4]
    rows.update([a, b, c])
    a.append(2)
    c[-1] = 5
    assert rows.update([a, b, c], changed=[0, 2]) == ([0, 2], 3)
    np.testing.assert_array_equal(rows.rows[:3], reference_rows([a, b, c], 6))
    b.append(6)  # not reported: left alone (the caller vouches for the rows it does not name)
    assert rows.update([a, b, c], changed=[]) == ([], 0)
    np.testing.assert_array_equal(rows.rows[1], [9, 8, 7, 0, 0, 0])
    assert rows.update([a, b, c]) == ([1], 4)  # a full comparison still finds it


def test_block_table_rows_match_a_full_pack_under_random_edits():
    rng = random.Random(1)
    rows = BlockTableRows(np.zeros((8, 10), dtype=np.int32))
    live = [[rng.randrange(100) for _ in range(rng.randrange(1, 10))] for _ in range(8)]
    for _ in range(300):
        table = rng.choice(live)
        edit = rng.randrange(4)
        if edit == 0 and len(table) < 10:
            table.append(rng.randrange(100))
        elif edit == 1:
            table[rng.randrange(len(table))] = rng.randrange(100)
        elif edit == 2:
            rng.shuffle(live)
        batch = live[: rng.randrange(1, 9)]
        rows.update(batch)
        np.testing.assert_array_equal(rows.rows[: len(batch)], reference_rows(batch, 10))


def test_block_table_rows_move_shifted_tables_and_trust_the_changed_rows():
    """The engine's use: a batch loses and gains sequences (later rows shift, new ones append, rows trade
    places) and names only the rows whose own table was edited in place."""
    rng = random.Random(2)
    rows = BlockTableRows(np.zeros((12, 10), dtype=np.int32))
    device = np.zeros((12, 10), dtype=np.int32)  # the device tables: only rewritten rows reach them
    batch: list[list[int]] = []
    for _step in range(400):
        edited: set[int] = set()
        for _ in range(rng.randrange(3)):
            if batch:
                del batch[rng.randrange(len(batch))]  # a finished sequence: the rows after it shift
        if rng.random() < 0.2 and len(batch) > 1:
            i, j = rng.sample(range(len(batch)), 2)
            batch[i], batch[j] = batch[j], batch[i]
        while len(batch) < 12 and rng.random() < 0.5:
            batch.insert(
                rng.randrange(len(batch) + 1),
                [rng.randrange(100) for _ in range(rng.randrange(1, 8))],
            )
        for i, table in enumerate(batch):
            if rng.random() < 0.3:
                if len(table) < 10 and rng.random() < 0.7:
                    table.append(rng.randrange(100))
                else:
                    table[-1] = rng.randrange(100)
                edited.add(i)
        rewritten, width = rows.update(batch, changed=sorted(edited))
        np.testing.assert_array_equal(rows.rows[: len(batch)], reference_rows(batch, 10))
        assert rewritten == sorted(rewritten)
        device[rewritten, :width] = rows.rows[rewritten, :width]  # what the runner sends
        np.testing.assert_array_equal(device[: len(batch)], reference_rows(batch, 10))


def test_host_noise_keys_equal_the_device_hash():
    seeds = [0, 1, 2**31, 2**32 - 1, 2**32 + 5, 2**64 - 1, 2**63, 2**62]  # unsigned 64-bit
    steps = [0, 7, 3, 100000, 1, 2, 9, 5]
    bits = seed_bits(seeds)
    host = row_keys(bits, np.array(steps, dtype=np.int64))
    device = row_keys(torch.from_numpy(bits), torch.tensor(steps))
    assert host.tolist() == device.tolist()
    batch = SamplingBatch.build([1.0] * 8, [1.0] * 8, [0] * 8, seeds, steps, torch.device("cpu"))
    assert batch.keys.tolist() == host.tolist()
    assert not batch.all_greedy
    same_low_word = row_keys(seed_bits([5, 2**32 + 5, 2**63 + 5]), np.zeros(3, dtype=np.int64))
    assert len(set(same_low_word.tolist())) == 3  # the high word counts: seeds do not wrap at 2**32
    noise = gumbel_from_keys(batch.keys, 33)
    assert noise.shape == (8, 33) and torch.isfinite(noise).all()


def test_an_all_greedy_batch_has_no_rows():
    assert SamplingBatch.build(
        [0.0, 0.0], [0.5, 1.0], [0, 3], [1, 2], [0, 0], torch.device("cpu")
    ).all_greedy
