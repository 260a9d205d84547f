"""KV state and the record of what it was built from. Imports neither the runner nor the scheduler."""
