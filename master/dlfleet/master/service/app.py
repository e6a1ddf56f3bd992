"""The master service process, put together: the store, the state recovered
from it, and the gRPC server over that state, until SIGINT or SIGTERM.

`dlmaster` in serve mode (`dlfleet.master.__main__`) parses its flags and calls
`serve`; this is the one place where the service's objects are constructed.
"""

from __future__ import annotations

import asyncio
import gc
import signal

from dlfleet.api.serving.ports import Endpoint, check_port_free
from dlfleet.master.service.http_api import HttpSettings
from dlfleet.master.service.rpc import system_clock
from dlfleet.master.service.server import MasterServer
from dlfleet.master.service.state import MasterSettings, MasterState
from dlfleet.master.store.sql import open_store

# The cyclic collector's generations, in allocations (Python's defaults are
# 700 and 10). A master of thousands of nodes allocates a few hundred objects
# per RPC and holds hundreds of thousands (a session, its calls and buffers per
# node), and a fleet forming or re-forming allocates millions that live until
# its round forms: with the defaults, full collections over that heap were half
# of the master's CPU while 2,000 nodes joined, and a sixth of a lease+ack's;
# with a young generation of 20,000 and the middle one collected every 10 of
# those, 10,000 nodes registering and forming still cost the master about
# 1.4 s of collections (middle ones of up to 0.4 s each, traversing the joins
# still waiting). Young collections of 100,000 (a few ms each), the middle one
# every 50 of them, cut that to about 0.55 s, the middle ones to ms, and the
# master's CPU for re-forming 10,000 nodes after a loss by about a seventh.
GC_YOUNG_THRESHOLD = 100_000
GC_MIDDLE_THRESHOLD = 50


def tune_gc() -> None:
    """What exists once the master is up (modules, descriptors, the state
    recovered from the store) is never collected again: moved out of the
    generations the collector scans; and younger generations collected less
    often. Reference counting still frees everything as before."""
    gc.collect()
    gc.freeze()
    oldest = gc.get_threshold()[2]
    gc.set_threshold(GC_YOUNG_THRESHOLD, GC_MIDDLE_THRESHOLD, oldest)


async def serve(
    settings: MasterSettings,
    *,
    store_url: str,
    token: str,
    host: str,
    port: int,
    tls: tuple[bytes, bytes] | None,
    forget_nodes: bool,
    http: HttpSettings | None = None,
    resume: bool = False,
) -> None:
    """Serve on `host:port` (0 = a free port) until SIGINT or SIGTERM, printing
    `dlmaster: listening on HOST:PORT` once requests are accepted. With
    `http`, the HTTP endpoint too, announced first as `dlmaster: http on URL`.
    With `forget_nodes`, the nodes recovered from the store are dropped at
    once. A port in use is `PortInUse`, before the store is even opened; a
    store that holds a job this master may not take (another job's, or any
    without `resume`) is `StoreClaimError` (`MasterState.recover`)."""
    check_port_free(Endpoint.GRPC, host, port)
    if http is not None:
        check_port_free(Endpoint.HTTP, http.host, http.port)
    store = open_store(store_url)
    state = MasterState.recover(store, settings, system_clock(), resume=resume)
    server = MasterServer(state, token=token, host=host, port=port, tls=tls, http=http)
    try:
        bound = await server.start()
    except BaseException:
        state.close()
        raise
    if server.http is not None:
        print(f"dlmaster: http on {server.http.url}", flush=True)
    if forget_nodes:
        assert server.membership is not None
        for record in list(state.nodes.nodes.values()):
            await server.membership.node_lost(record.node_id, "its master was restarted")
    tune_gc()
    print(f"dlmaster: listening on {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
    state.close()
