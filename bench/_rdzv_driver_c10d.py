"""Rendezvous-benchmark driver for torch's c10d rendezvous (what `torchrun
--rdzv-backend=c10d` uses), run by bench/_rdzv_harness.py.

The server: one `TCPStore` server (is_master=True, multi_tenant=True, as torch's
`_create_tcp_store` hosts it), alone in its own process, started by the bench:

    python bench/_rdzv_driver_c10d.py serve --port P

One agent is what one torchrun agent does: `setup()` builds its handler exactly
as torch's registry does for `--rdzv-backend=c10d` (`_create_c10d_handler`:
`c10d_rendezvous_backend.create_backend(params)`, which connects the agent's
own TCPStore client, then `dynamic_rendezvous.create_handler(store, backend,
params)`); `join()` is one `handler.next_rendezvous()`, timed by the harness.

Every agent must look like a distinct node: torch names a node
`<local_addr>_<pid>_<local_id>` (`_NodeDescGenerator`), where `local_id` is a
process-wide counter bumped per handler, so the threads of one process get
distinct node ids and no two processes share a pid.

min_nodes = max_nodes = N: `_RendezvousJoinOp` completes the round the moment
the N-th participant adds itself (`_add_to_participants` marks it complete when
`len(participants) == max_nodes`), so `last_call_timeout` never comes into play.
Everything else is torch's default behaviour, untouched: the random 0-0.3 s
delay before a first join, the 1 s poll of the state while waiting for the
others, the keep-alive heartbeats every 5 s once joined, and the TCPStore
server that rank 0 starts and shares (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE`
unset).

`torch` is imported inside the functions, so the orchestrator can read
`server_command` without paying for the import.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

HERE = Path(__file__).resolve().parent


def server_command(
    python: str, port: int, nodes: int, workdir: Path, options: dict[str, str]
) -> tuple[list[str], str]:
    """The argv of the server process, and the text it prints once it accepts clients."""
    del nodes, workdir, options
    argv = [python, str(HERE / "_rdzv_driver_c10d.py"), "serve", "--port", str(port)]
    return argv, f"listening on 127.0.0.1:{port}"


class C10dAgent:
    def __init__(
        self, target: str, nodes: int, run_id: str, index: int, options: dict[str, str]
    ) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        timeout_s = int(float(options.get("timeout_s", "120")))
        self.index = index
        self._params = RendezvousParameters(
            backend="c10d",
            endpoint=target,
            run_id=run_id,
            min_nodes=nodes,
            max_nodes=nodes,
            local_addr="127.0.0.1",
            # The bench hosts the store; no agent tries to.
            is_host=False,
            # Store reads, and the whole join, give up after the run's cap.
            read_timeout=timeout_s,
            join_timeout=timeout_s,
        )
        self._handler: DynamicRendezvousHandler | None = None

    def setup(self) -> None:
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        backend, store = create_backend(self._params)
        self._handler = create_handler(store, backend, self._params)

    def join(self) -> dict[str, Any]:
        handler = self._handler
        assert handler is not None, "setup() first"
        info = handler.next_rendezvous()
        store_info = info.bootstrap_store_info
        assert store_info is not None
        # RendezvousInfo has no round; the handler's synced state has it.
        round_ = int(handler._state_holder.state.round)
        return {
            "round": round_,
            "rank": info.rank,
            "world_size": info.world_size,
            # Every member of one world bootstraps from the same store server.
            "group": f"{store_info.master_addr}:{store_info.master_port}",
        }

    def close(self) -> None:
        # Keep-alive heartbeats stop with the process; shutdown() would close
        # the rendezvous for everyone, which no agent of a healthy job does.
        self._handler = None


def make_agent(
    target: str, nodes: int, run_id: str, index: int, options: dict[str, str]
) -> C10dAgent:
    return C10dAgent(target, nodes, run_id, index, options)


def _serve(port: int) -> int:
    from torch._C._distributed_c10d import TCPStore

    store = TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=300),
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"c10d store: listening on 127.0.0.1:{store.port}", flush=True)
    # Bounded: the bench stops the server long before this.
    stop.wait(timeout=3600)
    del store
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the c10d rendezvous benchmark's TCPStore")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    return _serve(args.port)


if __name__ == "__main__":
    sys.exit(main())
