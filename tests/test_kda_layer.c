/* The KDA token mixer: gradients of every parameter and of the input against
 * central finite differences; causality of the whole layer; a segment's
 * forward in two calls (the final state alone, then the rest from another
 * incoming state) equal to the one-call forward bit for bit, and its backward
 * in two calls (the incoming state's gradient from the outputs first) equal
 * to the one-call backward; the short convolution's backward with its output
 * recomputed (conv_out NULL, as the layer runs it) equal to the one with it
 * stored, bit for bit; the CPU refusing gradient row strides it cannot write. */
#include "longmoe/backend.h"
#include "longmoe/kda_layer.h"
#include "test.h"

enum { B = 2, T = 21, D = 8, H = 2, KD = 4, W = 4 };

static lm_kda_layer_config config(lm_kda_gate gate) {
    lm_kda_layer_config c = {D, H, KD, W, 16, gate, -5.0f, 1e-6f, NULL, 0, NULL};
    return c;
}

/* Parameters of N(0, 0.3^2) from `seed` (rng goes on from there), mapped into p. */
static float *random_params(const lm_kda_layer_config *c, uint64_t seed, lm_rng *rng, lm_kda_layer_params *p) {
    size_t np = lm_kda_layer_specs(c, NULL);
    float *params = malloc(np * 4);
    lm_rng_seed(rng, seed);
    for (size_t i = 0; i < np; i++) params[i] = 0.3f * (float)lm_rng_normal(rng);
    lm_kda_layer_params_map(c, params, p);
    return params;
}

static double loss(const lm_kda_layer_config *c, const lm_kda_layer_params *p, float *acts,
                   const float *x, const float *r, float *y) {
    lm_kda_layer_acts a;
    lm_kda_layer_acts_map(c, B, T, acts, &a);
    if (lm_kda_layer_forward(c, p, &a, x, B, T, y)) return NAN;
    double L = 0;
    for (int i = 0; i < B * T * D; i++) L += (double)y[i] * r[i];
    return L;
}

static void check_gate(lm_kda_gate gate) {
    lm_kda_layer_config c = config(gate);
    lm_tensor_spec specs[LM_KDA_LAYER_NPARAMS];
    size_t np = lm_kda_layer_specs(&c, specs);
    float *params = malloc(np * 4), *grads = calloc(np, 4);
    lm_rng rng;
    lm_rng_seed(&rng, 40 + gate);
    /* larger weights than the init so gradients stand well above rounding */
    size_t off = 0;
    for (int s = 0; s < LM_KDA_LAYER_NPARAMS; s++) {
        size_t n = (size_t)(specs[s].rows * specs[s].cols);
        for (size_t i = 0; i < n; i++)
            params[off + i] = specs[s].init_value + (specs[s].role == LM_ROLE_MATRIX ? 0.4f : 0.3f) *
                              (float)lm_rng_normal(&rng);
        off += n;
    }
    lm_kda_layer_params p, g;
    lm_kda_layer_params_map(&c, params, &p);
    lm_kda_layer_params_map(&c, grads, &g);
    float x[B * T * D], r[B * T * D], y[B * T * D], dx[B * T * D];
    for (int i = 0; i < B * T * D; i++) {
        x[i] = (float)lm_rng_normal(&rng);
        r[i] = (float)lm_rng_normal(&rng);
    }
    /* the backward writes dx: what it held before must not show */
    for (int i = 0; i < B * T * D; i++) dx[i] = 100.0f + (float)lm_rng_normal(&rng);
    float *acts = malloc(lm_kda_layer_act_floats(&c, B, T) * 4);
    float *scratch = malloc(lm_kda_layer_scratch_floats(&c, B, T) * 4);
    lm_kda_layer_acts a;
    lm_kda_layer_acts_map(&c, B, T, acts, &a);
    CHECK(!lm_kda_layer_forward(&c, &p, &a, x, B, T, y), "%s", lm_last_error());
    CHECK(!lm_kda_layer_backward(&c, &p, &g, &a, x, r, B, T, dx, scratch), "%s", lm_last_error());
    /* every parameter tensor, then the input */
    off = 0;
    for (int s = 0; s <= LM_KDA_LAYER_NPARAMS; s++) {
        float *base = s < LM_KDA_LAYER_NPARAMS ? params + off : x;
        float *gbase = s < LM_KDA_LAYER_NPARAMS ? grads + off : dx;
        size_t n = s < LM_KDA_LAYER_NPARAMS ? (size_t)(specs[s].rows * specs[s].cols) : (size_t)(B * T * D);
        double num = 0, den = 0;
        size_t stride = n > 40 ? n / 40 : 1; /* a spread subset of entries */
        for (size_t i = 0; i < n; i += stride) {
            float keep = base[i], h = 2e-3f;
            base[i] = keep + h;
            double lp = loss(&c, &p, acts, x, r, y);
            base[i] = keep - h;
            double lm = loss(&c, &p, acts, x, r, y);
            base[i] = keep;
            double fd = (lp - lm) / (2 * h);
            num += (fd - gbase[i]) * (fd - gbase[i]);
            den += fd * fd;
        }
        double rel = sqrt(num / (den > 0 ? den : 1));
        CHECK(rel < 1e-2 && den > 0, "%s gate: %s rel error %.3g (|fd| %.3g)", gate ? "softplus" : "bounded",
              s < LM_KDA_LAYER_NPARAMS ? specs[s].name : "x", rel, sqrt(den));
        if (s < LM_KDA_LAYER_NPARAMS) off += n;
    }
    free(params); free(grads); free(acts); free(scratch);
}

static void test_layer_gradients_match_finite_differences_bounded(void) { check_gate(LM_KDA_GATE_BOUNDED); }
static void test_layer_gradients_match_finite_differences_softplus(void) { check_gate(LM_KDA_GATE_SOFTPLUS); }

static void test_layer_is_causal(void) {
    lm_kda_layer_config c = config(LM_KDA_GATE_BOUNDED);
    lm_rng rng;
    lm_kda_layer_params p;
    float *params = random_params(&c, 77, &rng, &p);
    float x[B * T * D], y1[B * T * D], y2[B * T * D];
    for (int i = 0; i < B * T * D; i++) x[i] = (float)lm_rng_normal(&rng);
    float *acts = malloc(lm_kda_layer_act_floats(&c, B, T) * 4);
    lm_kda_layer_acts a;
    lm_kda_layer_acts_map(&c, B, T, acts, &a);
    lm_kda_layer_forward(&c, &p, &a, x, B, T, y1);
    int P = 13;
    for (int b = 0; b < B; b++)
        for (int t = P; t < T; t++)
            for (int i = 0; i < D; i++) x[(b * T + t) * D + i] += 5.0f * (float)lm_rng_normal(&rng);
    lm_kda_layer_forward(&c, &p, &a, x, B, T, y2);
    for (int b = 0; b < B; b++) {
        CHECK(!memcmp(y1 + b * T * D, y2 + b * T * D, (size_t)P * D * 4), "outputs before %d changed (seq %d)", P, b);
        CHECK(memcmp(y1 + (b * T + P) * D, y2 + (b * T + P) * D, D * 4), "output at %d did not change", P);
    }
    free(params); free(acts);
}

/* lm_kda_layer_seg_final_state then lm_kda_layer_forward_seg_prepared from an
 * incoming state S give the one-call segment forward's y and acts from S, and
 * the first call's ht is the one-call forward's from a zero state. */
static void test_segment_forward_in_two_calls(void) {
    for (int gate = 0; gate < 2; gate++) {
        lm_kda_layer_config c = config((lm_kda_gate)gate);
        lm_rng rng;
        lm_kda_layer_params p;
        float *params = random_params(&c, 91 + gate, &rng, &p);
        const size_t ns = (size_t)B * H * KD * KD, nh = (size_t)3 * B * (W - 1) * H * KD, na = lm_kda_layer_seg_act_floats(&c, B, T);
        float x[B * T * D], y1[B * T * D], y2[B * T * D];
        float *S = malloc(ns * 4), *q1 = malloc(ns * 4), *q2 = malloc(ns * 4), *halo = malloc(nh * 4);
        float *h1 = malloc(nh * 4), *h2 = malloc(nh * 4), *acts1 = calloc(na, 4), *acts2 = calloc(na, 4);
        for (int i = 0; i < B * T * D; i++) x[i] = (float)lm_rng_normal(&rng);
        for (size_t i = 0; i < ns; i++) S[i] = 0.5f * (float)lm_rng_normal(&rng);
        for (size_t i = 0; i < nh; i++) halo[i] = (float)lm_rng_normal(&rng);
        lm_kda_layer_acts a1, a2;
        lm_kda_layer_seg_acts_map(&c, B, T, acts1, &a1);
        lm_kda_layer_seg_acts_map(&c, B, T, acts2, &a2);
        /* one call from zero (for ht), then one call from S */
        lm_kda_layer_carry z1 = {NULL, q1, halo, h1}, s1 = {S, NULL, halo, NULL};
        CHECK(!lm_kda_layer_forward_seg(&c, &p, &p, &a1, x, B, T, &z1, y1), "%s", lm_last_error());
        CHECK(!lm_kda_layer_forward_seg(&c, &p, &p, &a1, x, B, T, &s1, y1), "%s", lm_last_error());
        /* two calls */
        lm_kda_layer_carry z2 = {NULL, q2, halo, h2}, s2 = {S, NULL, halo, NULL};
        for (int i = 0; i < B * T * D; i++) y2[i] = NAN;
        CHECK(!lm_kda_layer_seg_final_state(&c, &p, &p, &a2, x, B, T, &z2), "%s", lm_last_error());
        int untouched = 1;
        for (int i = 0; i < B * T * D; i++) untouched &= isnan(y2[i]);
        CHECK(untouched, "gate %d: the final state's call wrote outputs", gate);
        CHECK(!lm_kda_layer_forward_seg_prepared(&c, &p, &p, &a2, x, B, T, &s2, y2), "%s", lm_last_error());
        CHECK(!memcmp(q1, q2, ns * 4), "gate %d: the final state from zero differs from the one-call forward's", gate);
        CHECK(!memcmp(h1, h2, nh * 4), "gate %d: the outgoing halo differs", gate);
        CHECK(!memcmp(y1, y2, sizeof y1), "gate %d: y differs from the one-call forward's", gate);
        CHECK(!memcmp(acts1, acts2, na * 4), "gate %d: the activations differ from the one-call forward's", gate);
        /* and the incoming state mattered: from zero, y is another */
        float y0[B * T * D];
        CHECK(!lm_kda_layer_forward_seg_prepared(&c, &p, &p, &a2, x, B, T, &z2, y0), "%s", lm_last_error());
        CHECK(memcmp(y0, y2, sizeof y0), "gate %d: the incoming state did not change y", gate);
        lm_kda_layer_carry bad = {NULL, NULL, halo, NULL};
        CHECK(lm_kda_layer_seg_final_state(&c, &p, &p, &a2, x, B, T, &bad) == LM_ERR_ARG, "no ht accepted");
        free(params); free(S); free(q1); free(q2); free(halo); free(h1); free(h2); free(acts1); free(acts2);
    }
}

/* lm_kda_layer_seg_state_grad then lm_kda_layer_backward_seg_after_state add
 * to dx and the gradients what lm_kda_layer_backward_seg adds, bit for bit
 * (dh0 and the halo's gradient too), and the first call's dh0 is the one-call
 * backward's with no outgoing state gradient. */
static void test_segment_backward_in_two_calls(void) {
    for (int gate = 0; gate < 2; gate++) {
        lm_kda_layer_config c = config((lm_kda_gate)gate);
        lm_tensor_spec specs[LM_KDA_LAYER_NPARAMS];
        size_t np = lm_kda_layer_specs(&c, specs);
        lm_rng rng;
        lm_kda_layer_params p;
        float *params = random_params(&c, 95 + gate, &rng, &p);
        const size_t ns = (size_t)B * H * KD * KD, nh = (size_t)3 * B * (W - 1) * H * KD,
                     na = lm_kda_layer_seg_act_floats(&c, B, T), nsc = lm_kda_layer_seg_scratch_floats(&c, B, T);
        float x[B * T * D], y[B * T * D], dy[B * T * D];
        float *S = malloc(ns * 4), *dS = malloc(ns * 4), *halo = malloc(nh * 4), *dhalo_out = malloc(nh * 4);
        float *acts = calloc(na, 4), *scr = calloc(nsc, 4), *junk = calloc(lm_kda_layer_seg_state_grad_junk_floats(&c), 4);
        float *g1 = calloc(np, 4), *g2 = calloc(np, 4), *g0 = calloc(np, 4), *dx1 = calloc(B * T * D, 4),
              *dx2 = calloc(B * T * D, 4), *dx0 = calloc(B * T * D, 4);
        float *dh1 = malloc(ns * 4), *dh2 = malloc(ns * 4), *D1 = malloc(ns * 4), *D0 = malloc(ns * 4);
        float *dhl1 = malloc(nh * 4), *dhl2 = malloc(nh * 4);
        for (int i = 0; i < B * T * D; i++) x[i] = (float)lm_rng_normal(&rng), dy[i] = (float)lm_rng_normal(&rng);
        for (size_t i = 0; i < ns; i++) S[i] = 0.5f * (float)lm_rng_normal(&rng), dS[i] = (float)lm_rng_normal(&rng);
        for (size_t i = 0; i < nh; i++) halo[i] = (float)lm_rng_normal(&rng), dhalo_out[i] = (float)lm_rng_normal(&rng);
        /* the gradients start non-zero: both forms accumulate */
        for (size_t i = 0; i < np; i++) g1[i] = g2[i] = 0.01f * (float)lm_rng_normal(&rng);
        lm_kda_layer_acts a;
        lm_kda_layer_seg_acts_map(&c, B, T, acts, &a);
        lm_kda_layer_params G1, G2, G0;
        lm_kda_layer_params_map(&c, g1, &G1);
        lm_kda_layer_params_map(&c, g2, &G2);
        lm_kda_layer_params_map(&c, g0, &G0);
        lm_kda_layer_carry cr = {S, NULL, halo, NULL};
        CHECK(!lm_kda_layer_forward_seg(&c, &p, &p, &a, x, B, T, &cr, y), "%s", lm_last_error());
        lm_kda_layer_carry_grad cg1 = {dS, dh1, dhalo_out, dhl1}, cg0 = {NULL, D0, NULL, NULL};
        CHECK(!lm_kda_layer_backward_seg(&c, &p, &p, &G1, &a, x, dy, B, T, &cr, &cg1, dx1, scr), "%s", lm_last_error());
        CHECK(!lm_kda_layer_backward_seg(&c, &p, &p, &G0, &a, x, dy, B, T, &cr, &cg0, dx0, scr), "%s", lm_last_error());
        lm_kda_layer_carry_grad cg2 = {dS, dh2, dhalo_out, dhl2};
        CHECK(!lm_kda_layer_seg_state_grad(&c, &p, &p, &G2, &a, x, dy, B, T, &cr, dx2, D1, junk, scr), "%s",
              lm_last_error());
        CHECK(!memcmp(D1, D0, ns * 4), "gate %d: the incoming state's gradient from the outputs alone differs", gate);
        CHECK(!lm_kda_layer_backward_seg_after_state(&c, &p, &p, &G2, &a, x, B, T, &cr, &cg2, dx2, scr), "%s",
              lm_last_error());
        CHECK(!memcmp(dx1, dx2, (size_t)B * T * D * 4), "gate %d: dx differs from the one-call backward's", gate);
        CHECK(!memcmp(dh1, dh2, ns * 4), "gate %d: dh0 differs", gate);
        CHECK(!memcmp(dhl1, dhl2, nh * 4), "gate %d: the halo's gradient differs", gate);
        size_t off = 0;
        for (int t = 0; t < LM_KDA_LAYER_NPARAMS; t++) {
            size_t m = (size_t)(specs[t].rows * specs[t].cols);
            CHECK(!memcmp(g1 + off, g2 + off, m * 4), "gate %d: d%s differs from the one-call backward's", gate,
                  specs[t].name);
            off += m;
        }
        /* and the outgoing state's gradient mattered (to dx: over 21 tokens of these gates the map P
         * underflows, so dh0 is D's bits) */
        float *dx3 = calloc(B * T * D, 4);
        lm_kda_layer_carry_grad cg3 = {NULL, NULL, dhalo_out, NULL};
        CHECK(!lm_kda_layer_backward_seg(&c, &p, &p, &G0, &a, x, dy, B, T, &cr, &cg3, dx3, scr), "%s", lm_last_error());
        CHECK(memcmp(dx1, dx3, (size_t)B * T * D * 4), "gate %d: dht did not change dx", gate);
        free(dx3);
        free(params); free(S); free(dS); free(halo); free(dhalo_out); free(acts); free(scr); free(junk);
        free(g1); free(g2); free(g0); free(dx1); free(dx2); free(dx0); free(dh1); free(dh2); free(D1); free(D0);
        free(dhl1); free(dhl2);
    }
}

/* The CPU backend's conv_silu ops without the conv output (conv_out NULL: not
 * written by the forward, recomputed by the backward) give the operator input,
 * 1/||.||, din and dw (+= onto the same start) of the stored conv output, bit
 * for bit, with and without the norm: several sequences, odd T (one shorter
 * than the kernel), W 1 to 4. */
static void test_conv_backward_recomputing_the_conv_equals_the_stored_one(void) {
    /* (B, T, C, W, head_dim) */
    static const int shapes[][5] = {{2, 37, 64, 4, 32}, {3, 21, 96, 3, 32}, {1, 9, 32, 1, 16}, {3, 3, 48, 4, 16},
                                    {2, 15, 32, 2, 8}};
    lm_backend *be = lm_backend_cpu();
    lm_rng rng;
    lm_rng_seed(&rng, 123);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int *s = shapes[si], nb = s[0], nt = s[1], nc = s[2], nw = s[3], hd = s[4];
        const size_t n = (size_t)nb * nt * nc, cw = (size_t)nc * nw, rows = n / (size_t)hd;
        for (int norm = 1; norm >= 0; norm--) {
            float *in = malloc(n * 4), *w = malloc(cw * 4), *dout = malloc(n * 4), *dw0 = malloc(cw * 4);
            for (size_t i = 0; i < n; i++) in[i] = (float)lm_rng_normal(&rng), dout[i] = (float)lm_rng_normal(&rng);
            for (size_t i = 0; i < cw; i++)
                w[i] = (float)(lm_rng_normal(&rng) / sqrt(nw)), dw0[i] = 0.1f * (float)lm_rng_normal(&rng);
            float *conv = malloc(n * 4), *out1 = malloc(n * 4), *out2 = malloc(n * 4), *rn1 = malloc(rows * 4),
                  *rn2 = malloc(rows * 4), *tmp = malloc(n * 4), *din1 = malloc(n * 4), *din2 = malloc(n * 4);
            float *dw1 = malloc(cw * 4), *dw2 = malloc(cw * 4);
            memset(din2, 0xFF, n * 4); /* NaN: every value must be written */
            memcpy(dw1, dw0, cw * 4);
            memcpy(dw2, dw0, cw * 4);
            CHECK(!be->ops->conv_silu_forward(be, conv, out1, norm ? rn1 : NULL, in, w, nb, nt, nc, nw, hd), "%s",
                  lm_last_error());
            CHECK(!be->ops->conv_silu_forward(be, NULL, out2, norm ? rn2 : NULL, in, w, nb, nt, nc, nw, hd), "%s",
                  lm_last_error());
            CHECK(!memcmp(out1, out2, n * 4), "(%d,%d,%d,%d,%d) norm %d: the output differs without conv_out", nb, nt,
                  nc, nw, hd, norm);
            if (norm)
                CHECK(!memcmp(rn1, rn2, rows * 4), "(%d,%d,%d,%d,%d): rnorm differs without conv_out", nb, nt, nc, nw,
                      hd);
            CHECK(!be->ops->conv_silu_backward(be, din1, dw1, dout, conv, out1, norm ? rn1 : NULL, in, w, nb, nt, nc,
                                               nw, hd, tmp),
                  "%s", lm_last_error());
            CHECK(!be->ops->conv_silu_backward(be, din2, dw2, dout, NULL, out1, norm ? rn1 : NULL, in, w, nb, nt, nc,
                                               nw, hd, tmp),
                  "%s", lm_last_error());
            CHECK(!memcmp(din1, din2, n * 4), "(%d,%d,%d,%d,%d) norm %d: din differs with the conv recomputed", nb, nt,
                  nc, nw, hd, norm);
            CHECK(!memcmp(dw1, dw2, cw * 4), "(%d,%d,%d,%d,%d) norm %d: dw differs with the conv recomputed", nb, nt,
                  nc, nw, hd, norm);
            CHECK(memcmp(dw1, dw0, cw * 4), "(%d,%d,%d,%d,%d) norm %d: dw did not change", nb, nt, nc, nw, hd, norm);
            free(in); free(w); free(dout); free(dw0); free(conv); free(out1); free(out2); free(rn1); free(rn2);
            free(tmp); free(din1); free(din2); free(dw1); free(dw2);
        }
    }
}

/* The CPU writes the gradients that feed products as dense fp32 rows (its product format is the fp32
 * tensor itself): a row stride it cannot honour is refused by name, and it offers no strided product
 * or conversion, so the layer takes one product a weight there. */
static void test_cpu_refuses_strided_gradient_rows(void) {
    lm_backend *be = lm_backend_cpu();
    float buf[64] = {0};
    lm_status st = be->ops->kda_output_backward(be, buf, NULL, buf, 2 * 4 + 8, buf, buf, buf, buf, buf, buf, 1, 2, 4,
                                                1e-6f, buf);
    CHECK(st == LM_ERR_ARG && strstr(lm_last_error(), "ld_dgate_lp"), "kda_output_backward took a row stride: %s",
          lm_last_error());
    lm_kda_config kc = lm_kda_config_default(1, 1, 2, 4, 4);
    kc.dz_ld = 2 * 4 + 8;
    st = be->ops->kda_backward(be, &kc, buf, buf, buf, buf, buf, buf, buf, NULL, buf, NULL, buf, buf, buf, buf, buf,
                               buf, buf, NULL);
    CHECK(st == LM_ERR_ARG && strstr(lm_last_error(), "dz_ld"), "kda_backward took a dz row stride: %s",
          lm_last_error());
    CHECK(!be->ops->matmul_backward_ld && !be->ops->to_lp_rows, "the CPU offers strided products or conversions");
}

int main(void) {
    RUN(test_layer_gradients_match_finite_differences_bounded);
    RUN(test_layer_gradients_match_finite_differences_softplus);
    RUN(test_layer_is_causal);
    RUN(test_segment_forward_in_two_calls);
    RUN(test_segment_backward_in_two_calls);
    RUN(test_conv_backward_recomputing_the_conv_equals_the_stored_one);
    RUN(test_cpu_refuses_strided_gradient_rows);
    return test_summary();
}
