"""`make demo`: Noctaya's scale-from-zero path on one machine, without a cluster."""
