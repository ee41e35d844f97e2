"""The CUDA kernels and the host stage on one GPU (a group of one rank over NCCL): a load whose
checkpoint mixes GPU, pinned and pageable tensors in the same buckets (runs packed on the device,
copied straight from pinned memory and staged by threads), strided and expanded sources, a transposed destination
(the scatter kernel's boxed path) and casts, bitwise against torch's own CUDA copy_.

Skipped without a GPU; bench/device_run.sh runs it (gputest).
"""
import contextlib
import os
import tempfile
import time
import warnings

import pytest
import torch
import torch.nn as nn

import coalesced_bcast
from dist_utils import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU")


def _mixed_body(rank, world_size, pinned_only=False, refused=False):
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(4)
    shapes = [(300, 1024), (7,), (256, 257), (1000,), (64, 4096), (3, 5, 7)] + [(50 + i,) for i in range(120)]
    full = {}
    for i, shape in enumerate(shapes):
        t = torch.empty(shape, dtype=torch.bfloat16 if i % 4 else torch.float32)
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
        full[f"p{i}"] = t
    expanded = ("p8", "p9", "p10")  # stride-0 views (as torch.save keeps expand()ed tensors): GPU, pinned, pageable
    for k in expanded:
        full[k] = full[k][:1].expand(full[k].shape)
    kinds = [lambda v: v.to(dev), lambda v: v.pin_memory(), lambda v: v,
             lambda v: v.t().contiguous().t() if v.dim() == 2 else v]  # device, pinned, pageable, strided
    strided_pinned = {"p2"}  # 131 KB, read element by element by the copy kernel
    if pinned_only:  # every host run pinned: p0's large runs by the copy engine, the others by the copy kernel
        kinds = [lambda v: v.pin_memory()]
    if not refused:
        _mixed_loads(dev, full, expanded, kinds, strided_pinned, pinned_only, refused)
        return
    # The runtime refuses the first load's first batch: one warning (c10 logs the extension's TORCH_WARN to
    # stderr where no Python handler takes it), and the copy kernel reads every run of both loads.
    coalesced_bcast._C._test_refuse_next_host_batch(True)
    with _stderr_kept() as logged, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _mixed_loads(dev, full, expanded, kinds, strided_pinned, pinned_only, refused)
        text = logged() + "".join(str(w.message) for w in caught)
    assert text.count("cudaMemcpyBatchAsync failed (") == 1, text[-2000:]


@contextlib.contextmanager
def _stderr_kept():
    """This process's stderr (fd 2) into a file for the block; yields a function that reads it."""
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield lambda: (f.seek(0), f.read().decode(errors="replace"))[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _mixed_loads(dev, full, expanded, kinds, strided_pinned, pinned_only, refused):
    for cast in (False, True):
        model = nn.Module()
        for k, v in full.items():
            dtype = torch.bfloat16 if cast else v.dtype
            p = torch.full(v.shape, -1.0, dtype=dtype, device=dev)
            if k == "p2":  # a transposed destination: written through the boxed path
                p = torch.full(v.shape[::-1], -1.0, dtype=dtype, device=dev).t()
            model.register_parameter(k, nn.Parameter(p))
        # (torch cannot pin or move an expanded tensor as it is: the kinds take its copy, then expand that again)
        sd = {k: kinds[i % len(kinds)](v.contiguous() if k in expanded else v) for i, (k, v) in enumerate(full.items())}
        sd.update({k: sd[k][:1].expand(full[k].shape) for k in expanded})
        if pinned_only:
            sd.update({k: full[k].t().contiguous().t().pin_memory() for k in strided_pinned})
            assert all(v.is_pinned() for v in sd.values()) and not sd["p2"].is_contiguous()
        stats = coalesced_bcast.load_full_state_dict(model, sd, bucket_bytes=256 << 10, copy_threads=3)
        torch.cuda.synchronize()
        for k, v in full.items():
            got = getattr(model, k)
            want = v.to(dev).to(got.dtype)  # torch's own CUDA cast
            assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), \
                f"cast {cast}: '{k}' differs"
        assert stats.buckets == 10 and stats.cast_keys == (sum(v.dtype != torch.bfloat16 for v in full.values())
                                                          if cast else 0)
        # p0 (1.2 MB on the GPU) spans several buckets: those inside it go straight from it (direct buckets),
        # and the source's own scatter reads them there, casting when asked
        assert stats.direct_buckets >= 3 or pinned_only, stats
        if pinned_only:  # the host ring is only made for runs that the copy kernel does not read
            assert stats.host_ring_bytes == 0, stats
            # The contiguous pinned runs of 32 KiB up to 256 KiB (the pieces of large tensors that buckets
            # cut) go up through the batched copies: none or at least one such run; none once refused
            batched = stats.host_batched_bytes
            contiguous = sum(v.nbytes for k, v in sd.items() if k not in expanded and v.is_contiguous())
            if refused:
                assert batched == 0, stats
            else:
                assert batched == 0 or 32 << 10 <= batched <= contiguous, (stats, contiguous)


def test_load_mixed_sources_on_one_gpu():
    run_ranks(1, _mixed_body, backend="nccl", timeout=200)


@pytest.mark.parametrize("refused", [False, True], ids=["batch", "refused"])
def test_load_pinned_sources_on_one_gpu(refused):
    """Every source tensor pinned (contiguous and strided, small and large): the copy kernel reads the
    small and strided runs from host memory (those of 32 KiB or more, contiguous, the copy engine in batches
    beside it), the copy engine the large ones; refused: the runtime refuses the first batch's arguments
    (the test hook _C._test_refuse_next_host_batch): one warning, and the copy kernel reads every run of
    both loads (a driver without the call takes the same way, unwarned)."""
    if refused and not hasattr(coalesced_bcast._C, "_test_refuse_next_host_batch"):
        pytest.skip("this build has no _C._test_refuse_next_host_batch test hook")
    run_ranks(1, _mixed_body, True, refused, backend="nccl", timeout=200)


def _load_zeroed(model, sd, **options):
    """A load into `model` zeroed first."""
    for p in model.parameters():
        p.data.zero_()
    return coalesced_bcast.load_full_state_dict(model, sd, **options)


def _registered_body(rank, world_size):
    # Host memory pinned two ways: by torch's allocator (known by its deleter) and by cudaHostRegister on
    # pageable memory (asked of CUDA); large runs (2 MiB, the copy engine's) and small ones (64 KiB, the
    # copy kernel's) of each, then one small pageable run among them (the host ring's).
    full, model = _int16_weights(21, 4, 1 << 20)
    small, model_small = _int16_weights(22, 4, 32 << 10)
    for k, v in small.items():
        model.register_parameter("s" + k, model_small.get_parameter(k))
    full.update({"s" + k: v for k, v in small.items()})
    arena = torch.empty(sum(v.numel() for k, v in full.items() if k in ("w1", "w3", "sw1", "sw3")), dtype=torch.int16)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(arena.data_ptr(), arena.numel() * 2, 0)) == 0
    try:
        sd, at = {}, 0
        for k, v in full.items():
            if k in ("w1", "w3", "sw1", "sw3"):  # views of the registered arena: CPU allocator's storage
                sd[k] = arena[at:at + v.numel()].copy_(v.cpu())
                at += v.numel()
            else:
                sd[k] = v.cpu().pin_memory()
        assert all(v.is_pinned() for v in sd.values())
        routes = []
        for pageable in (False, True):
            if pageable:
                sd["sw0"] = sd["sw0"].clone()  # pageable
            for p in model.parameters():
                p.data.zero_()
            stats = coalesced_bcast.load_full_state_dict(model, sd)
            torch.cuda.synchronize()
            for k, v in full.items():
                assert torch.equal(model.get_parameter(k), v), (k, pageable)
            routes.append((pageable, stats.host_ring_bytes))
        # All pinned: nothing is staged through the host ring, whichever way pinned memory is known.
        assert [r[1] == 0 for r in routes] == [True, False], routes
    finally:
        cudart.cudaHostUnregister(arena.data_ptr())


def test_load_knows_memory_pinned_by_torch_and_by_cuda_host_register():
    run_ranks(1, _registered_body, backend="nccl", timeout=200)


def _flat_pinned_body(rank, world_size):
    # Views of one pinned buffer in stream order: adjacent direct runs go up as one copy. Sizes of whole
    # 16-byte words (adjacent in the slot too), an odd one (padding after it: a new copy), one larger than a
    # bucket (cut at the bucket's end), small ones between (the copy kernel's), in 4 MiB buckets.
    dev = torch.device("cuda", 0)
    numels = [150_000, 200_000, 130_001, 400_000, 3_000_000, 1_000, 300_000, 2_000, 140_000, 260_000]
    g = torch.Generator(device=dev).manual_seed(5)
    full = {f"t{i}": torch.randint(-2**15, 2**15, (n,), dtype=torch.int16, device=dev, generator=g)
            for i, n in enumerate(numels)}
    model = nn.Module()
    for k, v in full.items():
        model.register_parameter(k, nn.Parameter(torch.zeros_like(v), requires_grad=False))
    flat = torch.empty(sum(numels), dtype=torch.int16, pin_memory=True)
    sd, at = {}, 0
    for k, v in full.items():
        sd[k] = flat[at:at + v.numel()].copy_(v.cpu())
        at += v.numel()
    stats = coalesced_bcast.load_full_state_dict(model, sd, bucket_bytes=4 << 20)
    assert stats.host_ring_bytes == 0 and stats.buckets >= 3, stats
    flat.fill_(0)  # the load is done with the source once it returns
    torch.cuda.synchronize()
    for k, v in full.items():
        assert torch.equal(model.get_parameter(k), v), k


def test_load_from_views_of_one_pinned_buffer():
    run_ranks(1, _flat_pinned_body, backend="nccl", timeout=200)


def _int16_weights(seed, count, numel):
    """`count` random int16 tensors of `numel` on the GPU, and a model of zeroed parameters of their names."""
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(seed)
    full = {f"w{i}": torch.randint(-2**15, 2**15, (numel,), dtype=torch.int16, device=dev, generator=g)
            for i in range(count)}
    model = nn.Module()
    for k, v in full.items():
        model.register_parameter(k, nn.Parameter(torch.zeros_like(v), requires_grad=False))
    return full, model


def _overwrite_after_return_body(rank, world_size):
    # Large contiguous pinned tensors only: every run goes up by the copy engine straight from the caller's
    # memory (no host ring, no kernel reads), copies long enough that a read after the call returned would show.
    full, model = _int16_weights(9, 2, 128 << 20)
    sd = {k: v.cpu().pin_memory() for k, v in full.items()}
    torch.cuda.synchronize()
    stats = coalesced_bcast.load_full_state_dict(model, sd)
    # The caller may reuse its tensors once the call returns: the load must not read them any more. The last
    # tensor first, which the copies reach last.
    for v in reversed(list(sd.values())):
        v.fill_(0)
    torch.cuda.synchronize()
    assert stats.host_ring_bytes == 0, stats
    for k, v in full.items():
        assert torch.equal(getattr(model, k), v), f"'{k}' holds bytes written into the source after the load returned"


def test_load_from_pinned_memory_is_done_with_it_on_return():
    run_ranks(1, _overwrite_after_return_body, backend="nccl", timeout=200)


def _hooks_beside_copies_body(rank, world_size):
    full, model = _int16_weights(13, 4, 16 << 20)
    sd = {k: v.cpu().pin_memory() for k, v in full.items()}
    coalesced_bcast.load_full_state_dict(model, sd)  # NCCL's communicator, made once
    torch.cuda.synchronize()
    lane = _lane("copy")
    seen = []
    model.register_load_state_dict_post_hook(lambda m, keys: seen.append(lane.query()))
    # The copy lane held for about a second before the call: the copies of the source's memory queue behind it.
    with torch.cuda.stream(lane):
        torch.cuda._sleep(2_000_000_000)
    coalesced_bcast.load_full_state_dict(model, sd)
    assert seen == [False], f"the post-hook ran after the copies were done ({seen}): the host waited for them first"
    for v in sd.values():
        v.fill_(0)
    torch.cuda.synchronize()
    for k, v in full.items():
        assert torch.equal(getattr(model, k), v), f"'{k}' differs"


def test_load_post_hooks_run_while_the_host_copies_do():
    """The source's host does the load's post-hooks while its copies of host memory are still running (a
    prepack's copies queue behind the busy lane), and waits for those copies before it returns: the sources
    overwritten at once leave the model bitwise equal to them."""
    run_ranks(1, _hooks_beside_copies_body, backend="nccl", timeout=200)


def _dropped_prepared_body(rank, world_size, pinned):
    import coalesced_bcast.state_dict as load_module
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(17)
    # Large pinned runs (the copy engine) and small ones (the copy kernel's reads over the bus), 1 MiB buckets.
    shapes = [(2 << 20,)] * 2 + [(2048,)] * 64
    full = {f"w{i}": torch.randint(-2**15, 2**15, s, dtype=torch.int16, device=dev, generator=g)
            for i, s in enumerate(shapes)}
    model = nn.Module()
    for k, v in full.items():
        model.register_parameter(k, nn.Parameter(torch.zeros_like(v), requires_grad=False))
    # pageable: the host stage's threads copy the first buckets into pinned memory before the agreement
    sd = {k: v.cpu().pin_memory() if pinned else v.cpu() for k, v in full.items()}
    coalesced_bcast.load_full_state_dict(model, {k: torch.zeros_like(v) for k, v in sd.items()}, bucket_bytes=1 << 20)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    prepare, agree, made = coalesced_bcast._C.Plan.prepare, load_module._agree, []

    def recorded(plan, is_src, **options):
        made.append(prepare(plan, is_src, **options))
        return made[-1]

    def refused(*args):
        raise load_module.LoadStateDictError("a test's refusal, after the ring was made")

    coalesced_bcast._C.Plan.prepare, load_module._agree = recorded, refused
    try:
        with pytest.raises(load_module.LoadStateDictError, match="a test's refusal"):
            coalesced_bcast.load_full_state_dict(model, sd, bucket_bytes=1 << 20)
        assert len(made) == 1 and made[0].packed == 2, "the source did not pack its first buckets before the agreement"
        del made[:]  # the dropped run: its copies of the source's memory waited for, its ring freed
    finally:
        coalesced_bcast._C.Plan.prepare, load_module._agree = prepare, agree
    # Nothing of the caller's written, and done with the source's memory: it may change at once.
    for v in sd.values():
        v.neg_()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(dev) == base, "the dropped ring is still held"
    assert all(not getattr(model, k).any() for k in full), "a load refused in its agreement wrote the model"
    coalesced_bcast.load_full_state_dict(model, sd, bucket_bytes=1 << 20)
    torch.cuda.synchronize()
    for k, v in full.items():
        assert torch.equal(getattr(model, k), v.neg()), f"'{k}' differs"


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_load_prepared_before_its_agreement_is_dropped_clean(pinned):
    """A load's source packs its first buckets from host memory before the agreement; refused there, that run
    is dropped: the model unwritten, the ring freed, the source's memory no longer read, the next load bitwise."""
    run_ranks(1, _dropped_prepared_body, pinned, backend="nccl", timeout=200)


def _prepack_body(rank, world_size):
    from coalesced_bcast import _C
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(23)
    # 1 MiB buckets: large runs (the copy engine's), small ones (the copy kernel's), a strided pinned tensor
    # (read element by element), tensors across bucket ends; the first two buckets are the prepack's.
    shapes = [(700 << 10,), (1000, 3)] + [(5000 + 16 * i,) for i in range(40)] + [(2 << 20,), (333, 77)]
    full = {f"w{i}": torch.randint(-2**15, 2**15, s, dtype=torch.int16, device=dev, generator=g)
            for i, s in enumerate(shapes)}
    model = nn.Module()
    for k, v in full.items():
        model.register_parameter(k, nn.Parameter(torch.zeros_like(v), requires_grad=False))
    model.register_parameter("w2b", model.w2)  # tied: one unit, in the first bucket, named again last
    pinned = {k: v.cpu().pin_memory() for k, v in full.items()}
    pinned["w1"] = full["w1"].cpu().t().contiguous().t().pin_memory()  # strided, in bucket 0
    assert not pinned["w1"].is_contiguous()
    pageable = {k: v.cpu() for k, v in full.items()}  # the first buckets staged by the host's threads
    for sd in (pinned, pageable):
        sd["w2b"] = sd["w2"]
    # The stream follows the model's order, not the table's (w0, w1, w10, w11, ...: a safetensors file's): the
    # source matches keys before it prepacks.
    sorted_keys = dict(sorted(pinned.items()))
    prepack_load = _C.prepack_load

    def backwards(table, canon, rows, *args):  # the units in another order than the load's: not taken
        return prepack_load(table, canon, torch.arange(table.size(0) - 1, -1, -1), *args)

    cases = ((pinned, 2, None), (pageable, 2, None), (sorted_keys, 2, None), (pinned, 0, backwards))
    for sd, want, patch in cases:
        _C.prepack_load = patch or prepack_load
        try:
            for _ in range(2):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
                stats = _load_zeroed(model, sd, bucket_bytes=1 << 20)
                torch.cuda.synchronize()
                extra = torch.cuda.max_memory_allocated(dev) - base
                for k, v in full.items():
                    assert torch.equal(model.get_parameter(k), v), (k, want, patch)
                assert stats.buckets > 4 and stats.prepacked_buckets == want, (stats, want, patch)
                assert (stats.host_ring_bytes > 0) == (sd is pageable), stats  # a prepack's staging counted too
                # the ring (2 x 1 MiB) and its tables: a prepack's ring is the load's, never a second one beside it
                assert extra < 2 * (2 << 20), (extra, stats)
                assert torch.cuda.memory_allocated(dev) == base, "the ring outlived the load"
        finally:
            _C.prepack_load = prepack_load


def test_load_source_packs_its_first_buckets_while_it_plans():
    """A load's source reads its first buckets from pinned or pageable host memory
    into its ring before its plan is made (csrc/prepack.cpp), in the model's key order whatever the checkpoint's,
    a tied tensor once; the load's ring is that one where the plan packs them the same way, and where it does not
    (a prepack in another order) it is dropped before the load makes its own: bitwise either way, one ring at a
    time."""
    run_ranks(1, _prepack_body, backend="nccl", timeout=200)


def _wrong_device_source_body(rank, world_size):
    import coalesced_bcast.state_dict as load_module
    model = nn.Module()
    model.a = nn.Parameter(torch.zeros(6))
    model.b = nn.Parameter(torch.zeros(4))
    model.c = nn.Parameter(torch.zeros(4))
    gpu = torch.arange(4.0, device="cuda")
    sd = {"a": torch.arange(6.0), "b": gpu, "c": gpu}  # the model on the CPU: b and c (one tensor, tied) refused
    with pytest.raises(load_module.LoadStateDictError) as e:
        coalesced_bcast.load_full_state_dict(model, sd)
    msg = str(e.value)
    for key in ('"b"', '"c"'):
        assert key in msg, msg
    assert "on cuda:0, but the model is on cpu" in msg, msg
    assert not model.a.any(), "a refused load wrote the model"
    sd["b"] = sd["c"] = gpu.cpu()
    coalesced_bcast.load_full_state_dict(model, sd)
    assert torch.equal(model.a, torch.arange(6.0)) and torch.equal(model.c, torch.arange(4.0))


def test_load_source_on_another_device_than_the_model_is_refused():
    """A source tensor on a device the model is not on is refused, naming its keys (the source describes its
    tensors beside reading the model's state: the device is checked after); then the load goes."""
    run_ranks(1, _wrong_device_source_body, backend="gloo", timeout=120)


def _busy_copy_lane_body(rank, world_size):
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(11)
    # 20,000 tensors of 256 bytes, back to back in one GPU buffer: every bucket goes straight from it (direct
    # buckets: no pack on the copy lane), and the source's own scatter, on the comm lane, reads the device
    # copy table (20,000 runs: a block of the allocator's large pool).
    n, width = 20000, 64
    flat = torch.randint(-2**31, 2**31 - 1, (n * width,), dtype=torch.int32, device=dev, generator=g)
    sd = {f"t{i}": flat[i * width:(i + 1) * width] for i in range(n)}
    model = nn.Module()
    for k in sd:
        model.register_parameter(k, nn.Parameter(torch.full((width,), -1, dtype=torch.int32, device=dev),
                                                 requires_grad=False))
    # A first load makes what is made once (NCCL's communicator, whose setup waits for the whole device) and
    # gives the size of the call's device block (all direct: the copy table alone).
    first = coalesced_bcast.load_full_state_dict(model, sd, bucket_bytes=1 << 20)
    for p in model.parameters():
        p.fill_(-1)
    # That block, zeroed and freed: the next call gets it back, so a table read before its upload is zeros.
    zeros = torch.zeros(first.ring_bytes, dtype=torch.uint8, device=dev)
    del zeros
    torch.cuda.synchronize()
    # Hold the copy lane, where the table goes up, for about a second.
    lane = _lane("copy")
    with torch.cuda.stream(lane):
        torch.cuda._sleep(2_000_000_000)
    stats = coalesced_bcast.load_full_state_dict(model, sd, bucket_bytes=1 << 20)
    assert not lane.query(), "the copy lane was not held through the load: the check below proves nothing"
    torch.cuda.synchronize()
    assert stats.buckets == 5 and stats.direct_buckets == 5, stats
    for k, v in sd.items():
        assert torch.equal(getattr(model, k), v), f"'{k}' differs"


def test_load_source_scatter_waits_for_the_table_upload():
    """A GPU source whose buckets all go straight from its tensors packs nothing on the copy lane, so its
    own scatter (comm lane) must still wait for the copy table's upload (copy lane): held here by a
    second-long kernel queued on the copy lane before the call."""
    run_ranks(1, _busy_copy_lane_body, backend="nccl", timeout=200)


def _lane(name):
    sid, index, dtype = coalesced_bcast._C._lane_stream(0, name)
    return torch.cuda.Stream(stream_id=sid, device_index=index, device_type=dtype)


def _stalled_comm_lane_body(rank, world_size, pinned):
    full, model = _int16_weights(12, 8, 4 << 20)
    # pinned: every run goes up by the copy engine, so end() is the host's only wait on the copies; pageable
    # with one slot: the staging ring's slot is waited for before each bucket, a wait on the last broadcast.
    sd = {k: v.cpu().pin_memory() if pinned else v.cpu() for k, v in full.items()}
    depth = 2 if pinned else 1
    # A first load makes what is made once (NCCL's communicator, whose setup waits for the whole device).
    coalesced_bcast.load_full_state_dict(model, sd, bucket_bytes=4 << 20, ring_depth=depth)
    torch.cuda.synchronize()
    # The comm lane stalls (as behind a peer that stopped), for far longer than the timeout: the copies into
    # slots wait on its broadcasts.
    with torch.cuda.stream(_lane("comm")):
        torch.cuda._sleep(16_000_000_000)
    t0 = time.monotonic()
    with pytest.raises(coalesced_bcast.CollectiveError, match="Timed out"):
        coalesced_bcast.load_full_state_dict(model, sd, bucket_bytes=4 << 20, ring_depth=depth, timeout=1.0)
    took = time.monotonic() - t0
    assert took < 4.0, f"raised after {took:.1f} s with a timeout of 1 s: the host waited on the stalled copies"


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_load_from_host_memory_raises_on_time_when_the_broadcasts_stall(pinned):
    """With a timeout, the source's host waits on its host-memory copies (end(), a staging slot) within the
    call's deadline: behind a stalled comm lane the load raises at the timeout instead of waiting for it."""
    run_ranks(1, _stalled_comm_lane_body, pinned, backend="nccl", timeout=200)


def _uint8_cast_body(rank, world_size):
    dev = torch.device("cuda", 0)
    vals = torch.tensor([-17.26, -136.75, -1.0, -0.5, 0.0, 0.7, 3.7, 127.5, 255.0, 300.5, -300.0, 1000.0] * 40)
    full = {f"{dtype}_{where}".replace("torch.", ""): vals.to(dtype)
            for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) for where in ("gpu", "pinned")}
    model = nn.Module()
    for k, v in full.items():
        model.register_parameter(k, nn.Parameter(torch.zeros(v.shape, dtype=torch.uint8, device=dev),
                                                 requires_grad=False))
    sd = {k: v.to(dev) if k.endswith("gpu") else v.pin_memory() for k, v in full.items()}
    stats = coalesced_bcast.load_full_state_dict(model, sd)
    torch.cuda.synchronize()
    assert stats.cast_keys == len(full), stats
    for k, v in full.items():
        want = v.to(dev).to(torch.uint8)  # torch's CUDA cast: through int64, negative values wrap
        got = getattr(model, k)
        assert torch.equal(got, want), f"'{k}': {got[:12].tolist()} against torch's {want[:12].tolist()}"


def test_load_casts_floats_into_uint8_as_torch_does():
    run_ranks(1, _uint8_cast_body, backend="nccl", timeout=200)


def offloaded_load_body(rank, world_size):
    """FSDP2 with CPUOffloadPolicy: the sharded parameters in pinned host memory, the buffers on the GPU.
    The load writes the host shards from the GPU (the scatter kernel, casting where asked) and returns once
    they are written: read on the host at once, with no synchronize, they are the checkpoint's bytes.
    Pageable offload (pin_memory=False): the same, through the host's threads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    mesh = init_device_mesh("cuda", (world_size,))

    def offloaded(pin, dtype):
        torch.manual_seed(0)
        # the last weight's shards (>= 256 KiB in fp32) go into host memory by the copy engine, unless cast
        model = nn.Sequential(nn.Linear(64, 301), nn.LayerNorm(301), nn.Linear(301, 600, bias=False)).to(dtype)
        model.register_buffer("steps", torch.zeros(5, device=dev))
        for m in model:
            fully_shard(m, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin))
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin))
        return model

    g = torch.Generator().manual_seed(11)
    ref = offloaded(True, torch.float32)
    full = {}
    for k, v in ref.state_dict().items():
        t = torch.empty(v.shape, dtype=torch.float32)
        t.view(torch.int32).copy_(torch.randint(-2**31, 2**31 - 1, t.shape, generator=g, dtype=torch.int32))
        full[k] = t
    full["0.weight"].view(-1)[:3] = torch.tensor([float("nan"), -0.0, float("-inf")])
    full["0.weight"].view(torch.int32).view(-1)[0] = 0x7FC00123  # a NaN with a payload
    for source in ("pinned", "gpu"):
        for dtype in (torch.float32, torch.bfloat16):  # bf16: the kernel casts on its way to host memory
            model = offloaded(True, dtype)
            locals_ = {k: v.to_local() for k, v in model.state_dict().items() if k != "steps"}
            assert all(t.is_cpu and t.is_pinned() for t in locals_.values()) and model.steps.is_cuda
            sd = None
            if rank == 0:
                sd = {k: v.pin_memory() if source == "pinned" else v.to(dev) for k, v in full.items()}
            stats = coalesced_bcast.load_full_state_dict(model, sd)
            for k, v in model.state_dict().items():
                local = v.to_local() if k != "steps" else v
                want = full[k].to(dev).to(dtype) if k != "steps" else full[k].to(dev)  # torch's own CUDA cast
                if k != "steps":
                    want = want.chunk(world_size)[rank].cpu()
                    assert local.is_cpu and local.is_pinned(), f"'{k}' left host memory"
                    assert local.data_ptr() == locals_[k].data_ptr(), f"'{k}' was not written in place"
                assert torch.equal(local.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), \
                    f"{source}, {dtype}: '{k}' differs on rank {rank}"
            assert stats.cast_keys == (len(full) - 1 if dtype != torch.float32 else 0), stats
    # Pageable host shards (pin_memory=False): written by the host's threads out of a pinned copy of each
    # bucket, in place, casting as torch's CPU copy does (a bf16 model: its cast of a NaN may keep another
    # payload than the GPU's, so NaNs are checked as NaNs there and every other value bit for bit).
    for source in ("pinned", "pageable", "gpu"):
        for dtype in (torch.float32, torch.bfloat16):
            model = offloaded(False, dtype)
            locals_ = {k: v.to_local() for k, v in model.state_dict().items() if k != "steps"}
            assert all(t.is_cpu and not t.is_pinned() for t in locals_.values())
            sd = None
            if rank == 0:
                sd = {k: v.pin_memory() if source == "pinned" else v.to(dev) if source == "gpu" else v.clone()
                      for k, v in full.items()}
            stats = coalesced_bcast.load_full_state_dict(model, sd, copy_threads=3)
            assert stats.host_ring_bytes > 0, stats  # the unstaging ring (and the source's stage, if pageable)
            for k, v in model.state_dict().items():
                if k == "steps":
                    assert torch.equal(v, full[k].to(dev)), k
                    continue
                local = v.to_local()
                assert local.data_ptr() == locals_[k].data_ptr() and not local.is_pinned(), f"'{k}' moved"
                want = full[k].to(dtype).chunk(world_size)[rank]  # torch's CPU cast
                if dtype == torch.float32:
                    assert torch.equal(local.view(torch.int32), want.contiguous().view(torch.int32)), \
                        f"pageable, {source}: '{k}' differs on rank {rank}"
                else:
                    nan = want.isnan()
                    assert torch.equal(local.isnan(), nan), f"pageable, {source}, bf16: '{k}' NaNs differ"
                    assert torch.equal(local[~nan].view(torch.int16), want[~nan].view(torch.int16)), \
                        f"pageable, {source}, bf16: '{k}' differs on rank {rank}"
            assert stats.cast_keys == (len(full) - 1 if dtype != torch.float32 else 0), stats


def test_load_into_fsdp2_cpu_offload():
    run_ranks(1, offloaded_load_body, backend="nccl", timeout=200)


def kept_table_body(rank, world_size, device_type="cuda"):
    """(tests/test_plan_reuse_gloo.py runs it on the CPU as well.)"""
    dev = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    cuda = dev.type == "cuda"
    memory = (lambda: (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())) if cuda else (lambda: None)
    tensors = [torch.zeros(512, dtype=torch.bfloat16, device=dev) for _ in range(2048)]  # 1 KiB each: 1024 a bucket
    plan = coalesced_bcast.plan_sync(tensors, src=0, bucket_bytes=1 << 20, ring_depth=2, speculate=True)

    def fill(step):
        for i, t in enumerate(tensors):
            t.view(torch.int16).fill_(step * 7 + i)

    def first_slot():  # what the packs of bucket 0 wrote: tensors 0..1023, in order
        if cuda:
            torch.cuda.synchronize()
        return plan._ring[:1 << 20].view(torch.int16).view(1024, 512)

    ring_ptr = None
    for step in range(5):
        fill(step)
        stats = plan.run()
        want = torch.stack([t.view(torch.int16) for t in tensors[:1024]])
        assert torch.equal(first_slot(), want), f"step {step}: the first slot is not bucket 0's new values"
        assert stats.speculated == (2 if step > 0 else 0), (step, stats)
        if step == 1:
            ring_ptr = plan._ring.data_ptr()
            base = memory()
        elif step > 1:
            assert plan._ring.data_ptr() == ring_ptr, "the ring was not kept"
    assert memory() == base
    # a re-allocated tensor, replanned: a new ring and table, which point at the new memory
    tensors[3].data = torch.zeros_like(tensors[3])
    for step in (10, 11):
        fill(step)
        stats = plan.run(replan=True)
        want = torch.stack([t.view(torch.int16) for t in tensors[:1024]])
        assert torch.equal(first_slot(), want), f"step {step}: the first slot is not bucket 0's new values"
        assert stats.speculated == (0 if step == 10 else 2), (step, stats)


def _kept_ring_lanes_body(rank, world_size):
    dev = torch.device("cuda", 0)
    tensors = [torch.zeros(512, dtype=torch.bfloat16, device=dev) for _ in range(4096)]  # 4 buckets of 1 MiB
    plan = coalesced_bcast.plan_sync(tensors, src=0, bucket_bytes=1 << 20, ring_depth=2, speculate=True)
    plan.run()
    torch.cuda.synchronize()
    ring = plan._ring
    assert ring is not None, "a speculating plan keeps its ring"
    # The last run's work on the copy lane (a receiver's unpacks) still running, as seen from a caller on
    # another stream: a kernel of ~1 s queued on that lane.
    with torch.cuda.stream(_lane("copy")):
        torch.cuda._sleep(2_000_000_000)
    other = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(other):
        prepared = plan._plan.prepare(True, pack=False, ring=ring)  # the next run's ring: the kept one
    mark = torch.cuda.Event()
    mark.record(_lane("comm"))
    time.sleep(0.05)
    ordered = not mark.query()  # the comm lane (its broadcasts into the slots) waits for the copy lane's tail
    del prepared
    torch.cuda.synchronize()
    assert ordered, "the comm lane did not wait for the copy lane's tail before writing the kept ring again"
    # and the plan still runs bitwise after it
    for i, t in enumerate(tensors):
        t.view(torch.int16).fill_(i)
    want = [t.clone() for t in tensors]
    plan.run()
    torch.cuda.synchronize()
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(tensors, want))


def test_kept_ring_orders_lanes_across_caller_streams():
    """A kept ring (speculate) is written by the next run's first broadcasts on the comm lane before the
    agreement; the run that last used it ordered only its own caller's stream after its lanes. So making the
    next run's ring from the kept one makes each lane wait for the other's tail (csrc/executor_cuda.cu hold()):
    with a second-long kernel on the copy lane, work queued on the comm lane after it does not run first."""
    run_ranks(1, _kept_ring_lanes_body, backend="nccl", timeout=120)


def test_speculating_kept_plan_packs_through_its_kept_table():
    """A group of one rank: a speculating kept plan keeps its ring, and the copy table in it is uploaded once
    (csrc/executor_cuda.cu set_table): each later run's packs still read every tensor's new values (the
    source's first slot holds bucket 0 bitwise), no memory grows, and a replanned run's new table points at
    a re-allocated tensor's new memory."""
    run_ranks(1, kept_table_body, backend="nccl", timeout=120)
