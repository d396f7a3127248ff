"""Engine integrations: code that attaches tracedump inside an engine the user does not edit.

Each module is loaded by its engine's own plugin mechanism (``vllm.general_plugins`` for
:mod:`tracedump.integrations.vllm`) and does nothing after one env lookup when dumping is off.
"""
