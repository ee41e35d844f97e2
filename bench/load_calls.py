"""Where a 16k-key FSDP2 load's host time goes, by the engine's calls: each load's phases (state_dict.py's
functions) beside the time of each _C call made in them (load_dests, the plan's wait, the post-hooks'
judgment, describe_tensors; a plan fed by load_dests is waited for in hooks.step), then each of those alone on warm objects, and a 1 GiB pinned host-to-device copy (the
load's floor). Rank 0's state pinned on its CPU (on a GPU).

    python3 -m torch.distributed.run --standalone --nproc-per-node 1 bench/load_calls.py
"""
import os, sys, time, torch, torch.distributed as dist, torch.nn as nn
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_setup, profile_load
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import coalesced_bcast
from coalesced_bcast import state_dict as S, _C
device = dist_setup.init()
cuda = device.type == "cuda"
mesh = init_device_mesh(device.type, (dist.get_world_size(),))
sizes = torch.randint(256, 65536, (16384,), generator=torch.Generator().manual_seed(0)).tolist()
with torch.device("meta"):
    model = nn.ParameterList([nn.Parameter(torch.empty(n)) for n in sizes]).to(torch.bfloat16)
fully_shard(model, mesh=mesh)
model.to_empty(device=device)
sd = {k: torch.zeros(v.shape, dtype=torch.bfloat16, pin_memory=cuda) for k, v in model.state_dict().items()}
if os.environ.get("LOAD_CALLS_SORTED") == "1":  # keys as a safetensors file keeps them ("0", "1", "10", ...)
    sd = dict(sorted(sd.items()))
spent: dict = {}  # seconds per _C call (or method of what one returned), summed over a load
cap: dict = {}  # the arguments of load_dests and start_load_plan, to call them again alone


def timed(key, fn):
    """fn, its wall time added to spent[key] at each call."""
    def run(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
    return run


class Timed:
    """obj with the methods named in `keys` timed under their key, the rest passed through."""
    def __init__(self, obj, keys):
        self._obj, self._keys = obj, keys

    def __getattr__(self, name):
        f = getattr(self._obj, name)
        return timed(self._keys[name], f) if name in self._keys else f


class TimedC:
    """_C with each function timed; the plan's wait and the post-hooks' judgment by their methods."""
    def __getattr__(self, name):
        f = getattr(_C, name)
        if name == "HookJudgment":
            return lambda model: Timed(timed("hooks.walk", f)(model), {"step": "hooks.step", "verdict": "hooks.verdict"})
        if not callable(f) or isinstance(f, type):
            return f

        def run(*a, **kw):
            if name in ("start_load_plan", "load_dests"):
                cap[name] = a
            r = timed(name, f)(*a, **kw)
            return Timed(r, {"result": "plan.result_wait"}) if name == "start_load_plan" else r
        return run


def sync():
    if cuda: torch.cuda.synchronize()
S._C = TimedC()
# The Python steps around the _C calls on the source's way to its first copy, timed under their names too
# (profile_load._wrapped: the same wrapping as the phases').
py_steps = [name for name in ("_model_state", "_walk_modules", "_match_keys", "_digest")
            if hasattr(S, name)]  # (an older tree, in an A/B run, may lack some)
model.state_dict = timed("model.state_dict", model.state_dict)  # the load's own call (keep_vars=True)
with profile_load._wrapped(py_steps, lambda name, call: timed(name, call)()):
    for i in range(6):
        spent.clear()
        with profile_load.phase_timers() as ph:
            sync(); t0 = time.perf_counter()
            coalesced_bcast.load_full_state_dict(model, sd)
            sync(); w = time.perf_counter() - t0
        print(f"load {i}: {w*1e3:.1f} ms | " + " ".join(f"{k}={v*1e3:.1f}" for k, v in ph.items()) + " | " + " ".join(f"{k}={v*1e3:.1f}" for k, v in sorted(spent.items(), key=lambda x: -x[1])), flush=True)
if "start_load_plan" not in cap:  # the plan was fed by load_dests (csrc/dest_feed.h): one load more, without, for "plan alone"
    os.environ["COALESCED_BCAST_LOAD_FEED"] = "0"
    coalesced_bcast.load_full_state_dict(model, sd)
    del os.environ["COALESCED_BCAST_LOAD_FEED"]
S._C = _C
del model.state_dict
def tm(fn, n=5):
    return dist_setup.best_ms(fn, cuda, n)
print(f"model.state_dict(): {tm(lambda: model.state_dict()):.1f} ms (keep_vars=True, as the load calls it: "
      f"{tm(lambda: model.state_dict(keep_vars=True)):.1f} ms)")
print(f"load_dests alone: {tm(lambda: _C.load_dests(*cap['load_dests'])):.1f} ms")
def plan_once():
    r = _C.load_dests(*cap["load_dests"]); a = list(cap["start_load_plan"]); a[2] = r[0]; a[3] = r[1]; a[0] = r[2]
    t0 = time.perf_counter(); _C.start_load_plan(*a).result(); return time.perf_counter() - t0
print(f"plan alone: {min(plan_once() for _ in range(5))*1e3:.1f} ms")
print(f"post_hooks_idle alone: {tm(lambda: _C.post_hooks_idle(model)):.1f} ms")
if cuda:
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True); dst = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    ms = tm(lambda: dst.copy_(src, non_blocking=True))
    print(f"H2D 1 GiB pinned: {ms:.1f} ms, {1.073741824/ms*1e3:.1f} GB/s")
dist.destroy_process_group()
