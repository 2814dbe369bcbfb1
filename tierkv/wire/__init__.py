"""What both ends of a vault connection share, and nothing stateful: the generated protocol code
(_pb, from proto/tierkv/v1/vault.proto by scripts/gen_proto.py), the bulk messages' fast
(de)serialisation (messages.py), the bulk port's framing (framing.py), call proofs (proofs.py)
and the secret files both read (secrets.py). The vault server (tierkv.vault) and its client
(tierkv.backends.vault) each import this, never each other."""
