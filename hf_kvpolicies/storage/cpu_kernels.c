/* Fused CPU reads of integer storage (see cpu_kernels.py): packed codes to float32 in one pass.
 *
 * Tensors are [rows, slots, inner] with rows = batch x heads, each row `*_row` elements apart and
 * its slots packed one after another. Codes are planar (affine.py): byte j of a slot's packed
 * vector holds the codes of channels j, j + packed, j + 2 packed, ... from its low bits up. Zero
 * points and scales are bfloat16. A number reads back as zero + code * scale in float32: the
 * product is exact, so the sum is the one rounding of the definition, as in PyTorch. */
#include <stdint.h>
#include <string.h>

#define MAX_WIDTH 1024

static inline float from_bfloat16(uint16_t half) {
    union { uint32_t bits; float value; } number;
    number.bits = (uint32_t)half << 16;
    return number.value;
}

/* The codes of one slot's vector, widened to float. */
static inline void unpack(float *restrict codes, const uint8_t *restrict bytes, int64_t width, int64_t packed, int64_t bits) {
    if (bits == 8) {
        for (int64_t c = 0; c < width; c++) codes[c] = (float)bytes[c];
        return;
    }
    const uint8_t mask = (uint8_t)((1 << bits) - 1);
    for (int64_t plane = 0; plane < 8 / bits; plane++) {
        const int64_t first = plane * packed, count = width - first < packed ? width - first : packed;
        const int shift = (int)(plane * bits);
        float *restrict out = codes + first;
        for (int64_t j = 0; j < count; j++) out[j] = (float)((uint8_t)(bytes[j] >> shift) & mask);
    }
}

/* Channel groups (keys): slot t of row r reads zero[r, t / group, c] + code * scale[r, t / group, c]. */
void decode_channel_groups(float *restrict out, const uint8_t *restrict codes, const uint16_t *restrict zero,
                           const uint16_t *restrict scale, int64_t rows, int64_t length, int64_t width,
                           int64_t packed, int64_t code_row, int64_t param_row, int64_t group, int64_t bits,
                           int64_t threads) {
    const int64_t groups = (length + group - 1) / group;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < groups; g++) {
            float zeros[MAX_WIDTH], scales[MAX_WIDTH], unpacked[MAX_WIDTH];
            const int64_t at = r * param_row + g * width;
            for (int64_t c = 0; c < width; c++) {
                zeros[c] = from_bfloat16(zero[at + c]);
                scales[c] = from_bfloat16(scale[at + c]);
            }
            const int64_t end = (g + 1) * group < length ? (g + 1) * group : length;
            for (int64_t t = g * group; t < end; t++) {
                unpack(unpacked, codes + r * code_row + t * packed, width, packed, bits);
                float *restrict row = out + (r * length + t) * width;
                for (int64_t c = 0; c < width; c++) row[c] = zeros[c] + unpacked[c] * scales[c];
            }
        }
    }
}

/* Token groups (values): slot t of row r reads zero[r, t, c / group] + code * scale[r, t, c / group]. */
void decode_token_groups(float *restrict out, const uint8_t *restrict codes, const uint16_t *restrict zero,
                         const uint16_t *restrict scale, int64_t rows, int64_t length, int64_t width,
                         int64_t packed, int64_t code_row, int64_t param_row, int64_t group, int64_t bits,
                         int64_t threads) {
    const int64_t groups = (width + group - 1) / group;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t t = 0; t < length; t++) {
            float unpacked[MAX_WIDTH];
            unpack(unpacked, codes + r * code_row + t * packed, width, packed, bits);
            const int64_t at = r * param_row + t * groups;
            float *restrict row = out + (r * length + t) * width;
            for (int64_t k = 0; k < groups; k++) {
                const float zero_k = from_bfloat16(zero[at + k]), scale_k = from_bfloat16(scale[at + k]);
                const int64_t end = (k + 1) * group < width ? (k + 1) * group : width;
                for (int64_t c = k * group; c < end; c++) row[c] = zero_k + unpacked[c] * scale_k;
            }
        }
    }
}

/* The residual laid over decoded slots: entry i < count of row r, shadowing slot slots[r, i] in
 * [0, length), writes its key and value (held side by side) there; other entries write nothing.
 * Elements are copied as they are, `element` bytes each (any dtype). */
void overlay_entries(char *restrict keys, char *restrict values, const char *restrict native,
                     const int64_t *restrict slots, int64_t rows, int64_t length, int64_t key_width,
                     int64_t value_width, int64_t size, int64_t count, int64_t element, int64_t threads) {
    const int64_t key_bytes = key_width * element, value_bytes = value_width * element;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < count; i++) {
            const int64_t slot = slots[r * size + i];
            if (slot < 0 || slot >= length) continue;
            const char *entry = native + (r * size + i) * (key_bytes + value_bytes);
            memcpy(keys + (r * length + slot) * key_bytes, entry, (size_t)key_bytes);
            memcpy(values + (r * length + slot) * value_bytes, entry + key_bytes, (size_t)value_bytes);
        }
    }
}
