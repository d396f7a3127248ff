"""Stage 2, pairing: which tensors of the two runs are one computation, each pair from evidence
recorded in the dumps (the engine's load record, a shared name, shared parameters, structure, a
hand rule), and the frozen plan of what to read. Metadata only: no tensor data is read here.
"""
