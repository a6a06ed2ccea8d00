"""Done flags: signal and wait, the same on every transport at the transport's memory scope
(``SCOPE``: "gpu" when every rank is on one device, "sys" when ranks are processes)."""

import triton
import triton.language as tl

# Stand-in for the generated file's constant (see rdepc.codegen.device).
SCOPE = tl.constexpr("gpu")


@triton.jit
def signal(flag, units=1):
    """Release ``units`` (default one) on ``flag``. The barrier comes first: a scalar atomic
    is executed by one thread, so without it the other warps' stores would not be ordered
    before it."""
    tl.debug_barrier()
    tl.atomic_add(flag, units, sem="release", scope=SCOPE)


@triton.jit
def wait(flag, target, bound, stop):
    """Acquire-spin until ``flag`` >= ``target``, at most ``bound`` spins, or until the word
    at ``stop`` (the call's error code) is set: once one wait of the call has failed, the
    others give up at once instead of each spending its own bound, so a dead peer costs a
    rank one bound, not one per waiting program. The value last seen. The barrier after it
    lets every warp of the program see what the acquire made visible."""
    seen = tl.atomic_add(flag, 0, sem="acquire", scope=SCOPE)
    spins = 0
    while (seen < target) & (spins < bound):
        seen = tl.atomic_add(flag, 0, sem="acquire", scope=SCOPE)
        spins = tl.where(tl.load(stop, volatile=True) != 0, bound, spins + 1)
    tl.debug_barrier()
    return seen
