"""``lmq bench soak``: a day in the life of a deployment, under faults (`run` is the entry)."""
