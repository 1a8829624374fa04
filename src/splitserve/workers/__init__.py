"""What the prefill and decode workers share: their config, the cluster-token
check, the block-event stream, and the process that hosts either role."""
