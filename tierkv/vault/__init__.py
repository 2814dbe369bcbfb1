"""The vault, the server side: a byte-capped RAM store of KV blocks (store.py) over an optional
disk tier (disk.py), served over gRPC (server.py) and the bulk data path (bulk.py), speaking
proto/tierkv/v1/vault.proto through tierkv/wire. Its client is a backend:
tierkv/backends/vault.py."""
