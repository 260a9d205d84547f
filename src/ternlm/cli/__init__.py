"""The `ternlm` command: main.py (the entry point and its subcommands), chat.py + chat_backends.py
(`ternlm chat`, local or against a server), info.py, models.py, cache.py. The serve, cluster and
bench subcommands live with their packages (server/cli.py, server/cluster.py, bench/cli.py).
May import anything in ternlm; nothing imports it but bench, which drives chat_backends.py (a chat
without a terminal) as its clients do."""
