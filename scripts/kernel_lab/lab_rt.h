// What the runtime-API labs (stream_lab.cu, sync_lab.cu) share: a check of each runtime call,
// which prints the failing call and exits. (The driver-API labs use lab_util.h.)
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                   \
    do {                                                                        \
        cudaError_t e_ = (x);                                                   \
        if (e_ != cudaSuccess) {                                                \
            printf("error in %s: %s\n", #x, cudaGetErrorString(e_));            \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

typedef unsigned int u32;
