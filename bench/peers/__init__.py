"""Peer benchmarks: vLLM and specserve on one GPU machine, the same prompts, the same timing method.

Each engine runs in a process of its own (``python3 -m bench.peers.run --engine vllm|specserve ...``, offline, with
``--profile-batch-sizes`` its decode step's kernels by class), its OpenAI server under our load generator
(``python3 -m bench.peers.served``); ``python3 -m bench.peers.report`` joins the JSONs of one session into the peer
tables (offline, served, profile: JSON + markdown + PNG). vLLM and Ray Serve come to the GPU machine as carried sets
(``bench.peers.carry_sets``); ``bench/peers/device.sh`` runs the stages there (see docs/performance.md, "specserve vs
vLLM", for the device calls).
"""
