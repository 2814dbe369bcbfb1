"""The vault: a RAM-only, byte-capped store of KV blocks (store.py), its gRPC server (server.py)
and the engine-side client (client.py), speaking proto/tierkv/v1/vault.proto."""
