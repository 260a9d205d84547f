/* The native weight layouts and scale modes: the ONLY place a layout is listed. qamx.c, qlanes.c and qint8.c
 * build their entries (tq_<layout>_<mode>_mm) from it, layer.c its dispatch table [layout][mode] and
 * validity checks, and kernels/build.py parses it (a regex over the LAYOUT / MODE / RAW_TYPE lines below) for
 * LAYOUT_CODE, MODE_CODE, RAW_LAYOUT, RAW_TYPES and the *_VARIANTS lists the Python side uses. Why one
 * table: the list was kept in five places (three C files, build.py, the Python callers) that had to agree
 * number for number; a new layout is now one LAYOUT line here plus its kernel code. The codes cross the
 * ctypes boundary (TqPart.layout / .mode): never renumber one.
 *
 * LAYOUT(name, code, family, bits, f32, f16, k, k6, f16s)
 *   name    the layout's name: models/qweight.py's fmt and the <layout> of its entries tq_<layout>_<mode>_mm
 *   code    its number in TqPart.layout (build.py LAYOUT_CODE; layer.c's MM row)
 *   family  the file whose kernels multiply it: ROW qamx.c (row layouts, the opt-in AMX build), LANES
 *           qlanes.c (16 rows in the vector lanes, fp32 activations), INT qint8.c (int8 activations),
 *           RAW qint8.c's tq_int8_raw_range (an expert's GGML blocks as read; its mode field is the GGML
 *           type, RAW_TYPE below; no entries of its own)
 *   bits    the code kind the family's kernels take: bits a weight's code is stored in (4 nibbles, 5 nibbles +
 *           a high bit, 6 i6x16's nibble + 2 bits, 8 bytes; Q6_K's codes are bytes in q8g16 / q6x16); the
 *           files' kind enums are named by it (qamx.c Q8, qlanes.c L8, qint8.c I8)
 *   f32 .. f16s  1 where the layout has an entry for that scale mode (the MODE lines' order), else 0
 *
 * MODE(name, code): a scale mode (models/qweight.py's mode, TqPart.mode, build.py MODE_CODE). The files'
 * own internal mode past these (*_F16I: f16s whose constant is the layout's own offset) is numbered after
 * them (TQ_NMODES) and never crosses the boundary.
 *
 * RAW_TYPE(ggml, code, layout, mode, bytes): a GGML type the RAW layout takes: its number (the part's mode),
 * the int layout and mode whose bits its product gives, the bytes of one GGML block (256 inputs).
 */
#ifndef TERNLM_LAYOUTS_H
#define TERNLM_LAYOUTS_H

#include <stdint.h>

#define TQ_MODES(MODE) \
    MODE(f32, 0)       \
    MODE(f16, 1)       \
    MODE(k, 2)         \
    MODE(k6, 3)        \
    MODE(f16s, 4)

/*                name    code family bits f32 f16 k k6 f16s */
#define TQ_LAYOUTS(LAYOUT)                           \
    LAYOUT(q4g32,  0, ROW,   4, 1, 1, 1, 0, 1)       \
    LAYOUT(q5g32,  1, ROW,   5, 1, 1, 1, 0, 1)       \
    LAYOUT(q8g16,  2, ROW,   8, 0, 0, 0, 1, 0)       \
    LAYOUT(q8g32,  3, ROW,   8, 1, 1, 0, 0, 1)       \
    LAYOUT(q4x16,  4, LANES, 4, 1, 1, 1, 0, 1)       \
    LAYOUT(q5x16,  5, LANES, 5, 1, 1, 1, 0, 1)       \
    LAYOUT(q8x16,  6, LANES, 8, 1, 1, 0, 0, 1)       \
    LAYOUT(q6x16,  7, LANES, 8, 0, 0, 0, 1, 0)       \
    LAYOUT(i4x16,  8, INT,   4, 1, 1, 1, 0, 1)       \
    LAYOUT(i5x16,  9, INT,   5, 1, 1, 1, 0, 1)       \
    LAYOUT(i8x16, 10, INT,   8, 1, 1, 0, 0, 1)       \
    LAYOUT(i6x16, 11, INT,   6, 0, 0, 0, 1, 0)       \
    LAYOUT(raw,   12, RAW,   0, 0, 0, 0, 0, 0)

/*                  ggml  code layout mode bytes */
#define TQ_RAW_TYPES(RAW_TYPE)              \
    RAW_TYPE(Q4_K, 12, i4x16, k, 144)       \
    RAW_TYPE(Q5_K, 13, i5x16, k, 176)       \
    RAW_TYPE(Q6_K, 14, i6x16, k6, 210)

/* ---- what the C files take from the table ----------------------------------------------------------- */

enum { TQ_ROW, TQ_LANES, TQ_INT, TQ_RAW };          /* the families */

#define TQ_MODE_ENUM(name, code) TQ_MODE_##name = code,
#define TQ_MODE_COUNT(name, code) +1
enum { TQ_MODES(TQ_MODE_ENUM) TQ_NMODES = 0 TQ_MODES(TQ_MODE_COUNT) };   /* codes 0 .. TQ_NMODES - 1 */

#define TQ_LAYOUT_ENUM(name, code, family, bits, a, b, c, d, e) TQ_LAYOUT_##name = code,
enum { TQ_LAYOUTS(TQ_LAYOUT_ENUM) };

/* TQ_EACH_MODE(V, layout, bits, <the row's five flags>): V(layout, mode, bits) for every mode the row flags
 * (the flags select by token pasting, so they are the literal 0 or 1). */
#define TQ_IF_0(...)
#define TQ_IF_1(...) __VA_ARGS__
#define TQ_EACH_MODE(V, L, bits, a, b, c, d, e) \
    TQ_IF_##a(V(L, f32, bits)) TQ_IF_##b(V(L, f16, bits)) TQ_IF_##c(V(L, k, bits)) TQ_IF_##d(V(L, k6, bits)) \
    TQ_IF_##e(V(L, f16s, bits))

/* TQ_LAYOUTS(TQ_ENTRIES_<family>): TQ_ENTRY(layout, mode, bits) for every entry of that family's layouts,
 * TQ_ENTRY being the file's own macro: how qamx.c (ROW), qlanes.c (LANES) and qint8.c (INT) write their
 * tq_<layout>_<mode>_mm entries. TQ_LAYOUTS(TQ_ENTRIES_ALL): every family's (layer.c's table). */
#define TQ_ENTRIES_ROW(L, code, fam, bits, a, b, c, d, e) TQ_ONLY_ROW_##fam(TQ_EACH_MODE(TQ_ENTRY, L, bits, a, b, c, d, e))
#define TQ_ENTRIES_LANES(L, code, fam, bits, a, b, c, d, e) \
    TQ_ONLY_LANES_##fam(TQ_EACH_MODE(TQ_ENTRY, L, bits, a, b, c, d, e))
#define TQ_ENTRIES_INT(L, code, fam, bits, a, b, c, d, e) TQ_ONLY_INT_##fam(TQ_EACH_MODE(TQ_ENTRY, L, bits, a, b, c, d, e))
#define TQ_ENTRIES_ALL(L, code, fam, bits, a, b, c, d, e) TQ_EACH_MODE(TQ_ENTRY, L, bits, a, b, c, d, e)
#define TQ_ONLY_ROW_ROW TQ_IF_1
#define TQ_ONLY_ROW_LANES TQ_IF_0
#define TQ_ONLY_ROW_INT TQ_IF_0
#define TQ_ONLY_ROW_RAW TQ_IF_0
#define TQ_ONLY_LANES_ROW TQ_IF_0
#define TQ_ONLY_LANES_LANES TQ_IF_1
#define TQ_ONLY_LANES_INT TQ_IF_0
#define TQ_ONLY_LANES_RAW TQ_IF_0
#define TQ_ONLY_INT_ROW TQ_IF_0
#define TQ_ONLY_INT_LANES TQ_IF_0
#define TQ_ONLY_INT_INT TQ_IF_1
#define TQ_ONLY_INT_RAW TQ_IF_0

/* Layout -> family, bits (-1 for a code no row has); whether (layout, mode) has an entry. For the checks of
 * a code that came over the boundary, not for inner loops. */
static inline int tq_layout_family(int64_t layout) {
    switch (layout) {
#define TQ_FAMILY_CASE(name, code, family, bits, a, b, c, d, e) case code: return TQ_##family;
    TQ_LAYOUTS(TQ_FAMILY_CASE)
#undef TQ_FAMILY_CASE
    default: return -1;
    }
}

static inline int tq_layout_bits(int64_t layout) {
    switch (layout) {
#define TQ_BITS_CASE(name, code, family, bits, a, b, c, d, e) case code: return bits;
    TQ_LAYOUTS(TQ_BITS_CASE)
#undef TQ_BITS_CASE
    default: return -1;
    }
}

static inline int tq_has_entry(int64_t layout, int64_t mode) {
#define TQ_ENTRY(L, M, bits) if (layout == TQ_LAYOUT_##L && mode == TQ_MODE_##M) return 1;
    TQ_LAYOUTS(TQ_ENTRIES_ALL)
#undef TQ_ENTRY
    return 0;
}

/* Whether a layout's products take int8 activations (INT, RAW: qint8.c), which layer.c quantizes once for
 * all of a projection's or an expert's parts. */
static inline int tq_layout_int8(int64_t layout) {
    const int f = tq_layout_family(layout);
    return f == TQ_INT || f == TQ_RAW;
}

#endif
