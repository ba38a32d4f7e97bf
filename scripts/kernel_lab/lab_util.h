// What the kernel labs (lab.cu, ops_lab.cu) share: driver-call checks, the context of device
// 0, and the timing of back-to-back launches with CUDA events.
#pragma once

#include <cuda.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                   \
    do {                                                        \
        CUresult r_ = (x);                                      \
        if (r_ != CUDA_SUCCESS) {                               \
            const char* s_;                                     \
            cuGetErrorString(r_, &s_);                          \
            printf("error in %s: %s\n", #x, s_);                \
            exit(1);                                            \
        }                                                       \
    } while (0)

// Makes device 0's primary context current (CUDA 13 has no cuCtxCreate with these arguments).
static inline void lab_init() {
    CK(cuInit(0));
    CUdevice dev;
    CK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
}

// Microseconds per launch: launch(i) for i < warmup, then the mean over launch(i) for
// i < iters, back to back on the default stream, timed by CUDA events.
template <class Launch>
static float lab_us_per_launch(Launch launch, int warmup, int iters) {
    for (int i = 0; i < warmup; i++) {
        launch(i);
    }
    CUevent a, b;
    CK(cuEventCreate(&a, 0));
    CK(cuEventCreate(&b, 0));
    CK(cuEventRecord(a, 0));
    for (int i = 0; i < iters; i++) {
        launch(i);
    }
    CK(cuEventRecord(b, 0));
    CK(cuEventSynchronize(b));
    float ms = 0;
    CK(cuEventElapsedTime(&ms, a, b));
    cuEventDestroy(a);
    cuEventDestroy(b);
    return 1000.0f * ms / iters;
}
