"""Glue for the RL loops people run: each module plugs xreshard into one framework.

    tunix.py    XreshardVllmRollout: a Tunix ``BaseRollout`` on a real vLLM engine, refit
                shard to shard from the actor mesh (extra ``tunix``)
    tunix_tables.py  the naming tables of Tunix's model families (Qwen2, Qwen3, Llama3,
                Gemma 1/2, Gemma3): Tunix paths -> the HF tensors vLLM loads
    ray.py      xreshard worlds of Ray actors: trainer actors and vLLM engine actors
                (extra ``ray``)

Importing this package imports neither; each module imports its framework when imported.
"""
