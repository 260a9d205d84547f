"""KV state and the record of what it was built from: slots.py (a sequence's KV + record + recurrent
state), record.py (what was fed, and the reuse decision), placement.py (the pure plan of where a prompt's
prefix comes from), the tiers (store.py over ram.py, disk.py, redis_tier.py; blocks.py / blockfile.py the
block format), spill.py, recurrent.py (a hybrid slot's state and snapshots).
May import: the helpers at ternlm's top only (never the runner, the scheduler or the models)."""
