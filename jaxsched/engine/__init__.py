"""The model-driving engine: request types (SamplingParams, RequestOutput), the step's flat
token batch, on-device sampling, the jitted step, the host bookkeeping of requests (packed
into the step's arrays, outputs, stop strings, stats counters), cache sizing,
preemption-cost measurement and placement of the model and cache over a device mesh."""
