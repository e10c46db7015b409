"""Prefill/decode disaggregation: the decode side's block leases (lease.py), the wire format and transports
(transport.py), and the two roles an engine core plays (roles.py).

The protocol (docs: DESIGN.md "Disaggregation"): the decode core reserves the blocks a prompt's KV needs past its
own prefix-cache hit under a lease, each block tagged with a generation; the prefill core computes the prompt
but its last token, snapshots the K/V of the leased range and pushes one frame per block with a digest, then a
`Done` listing every digest; the decode core writes only frames whose lease, generation and digest check out,
commits when every block arrived, computes the last prompt token itself and samples. A transfer that fails,
is aborted or outlives its lease releases its blocks (never while a write into them is in progress) and the
request falls back to prefilling on the decode core.
"""
