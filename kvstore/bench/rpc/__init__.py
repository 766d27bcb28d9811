"""``kvstore bench rpc``: the daemon's calls against what they stand beside.

Lookup latency, put/get GB/s through the socket and through shared memory, and small-call
throughput against a bare grpc.aio echo of the same payloads (``echo``); the call channel
against gRPC (``channel``); the socket path against redis-py SET/GET of the same 2 MiB values
(``redis_pairs``). ``run`` starts the daemon and the servers and puts the rows in one report;
``python -m kvstore.bench.rpc`` runs it without the ``kvstore`` command.
"""
