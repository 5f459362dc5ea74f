"""The cache service: supervisor process, slot allocation and eviction, start-up rebuild.

Uses every layer below (storage, shm, ipc, ioworkers). The supervisor is the only
mutator of the slot tables and the key index.
"""
