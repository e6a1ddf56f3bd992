"""The master service process, put together: the store, the state recovered
from it, and the gRPC server over that state, until SIGINT or SIGTERM.

`dlmaster` in serve mode (`dlfleet.master.__main__`) parses its flags and calls
`serve`; this is the one place where the service's objects are constructed.
"""

from __future__ import annotations

import asyncio
import signal

from dlfleet.master.service.http_api import HttpSettings
from dlfleet.master.service.rpc import system_clock
from dlfleet.master.service.server import MasterServer
from dlfleet.master.service.state import MasterSettings, MasterState
from dlfleet.master.store.sql import open_store


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
) -> None:
    """Serve on `host:port` (0 = a free port) until SIGINT or SIGTERM, printing
    `dlmaster: listening on HOST:PORT` once requests are accepted. With
    `http`, the HTTP endpoint too, announced first as `dlmaster: http on URL`.
    With `forget_nodes`, the nodes recovered from the store are dropped at
    once."""
    store = open_store(store_url)
    state = MasterState.recover(store, settings, system_clock())
    server = MasterServer(state, token=token, host=host, port=port, tls=tls, http=http)
    bound = await server.start()
    if server.http is not None:
        print(f"dlmaster: http on {server.http.url}", flush=True)
    if forget_nodes:
        assert server.membership is not None
        for record in list(state.nodes.nodes.values()):
            await server.membership.node_lost(record.node_id, "its master was restarted")
    print(f"dlmaster: listening on {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
    state.close()
