// decode_attn: kernels of the device-resident decode (see rust/engine/backend/cuda/decode/).
