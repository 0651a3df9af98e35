"""The model-driving engine: request types (SamplingParams, RequestOutput), the step's flat
token batch, on-device sampling, the jitted step, cache sizing, preemption-cost measurement
and placement of the model and cache over a device mesh."""
