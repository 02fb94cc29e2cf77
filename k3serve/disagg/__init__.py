"""A prefill group and a decode group as one disaggregated pair: the loop that drives both, and the local
(single-driver) pipeline built on it. Stands above the roles (`prefill/`, `decode/`, `transfer/`) and below
`cluster/`, whose front runs the same loop in its engine thread."""
