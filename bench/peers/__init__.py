"""Peer benchmarks: vLLM and specserve on one GPU machine, the same prompts, the same timing method.

Each engine runs in a process of its own (``python3 -m bench.peers.run --engine vllm|specserve ...``), writing one
JSON; ``python3 -m bench.peers.report`` joins the JSONs of one session into the peer table (JSON + markdown + PNG).
vLLM comes to the GPU machine as a carried bundle (see docs/performance.md, "Peer benchmarks", for the device calls).
"""
