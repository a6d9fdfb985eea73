/* `longmoe report`: a synthetic metrics.jsonl (train records with the expert
 * loads of two MoE layers, evaluations, stages, a skip, checkpoints, a passkey
 * and an MQAR grid, malformed lines) becomes one self-contained HTML file whose
 * charts, heatmaps and summary say what the log says; long logs are averaged
 * into a bounded page; bad run directories fail with a clear message. Where
 * Chromium is installed, the page is rendered headless to a screenshot. */
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "longmoe/config.h"
#include "longmoe/report.h"
#include "test.h"

static char root[256];

static const char *path_in(const char *name) { return test_path(root, name); }

static int run_cli(const char *args) { return test_run_cli(args, path_in("out.txt"), path_in("err.txt")); }

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc((size_t)n + 1);
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    if (p) p[n] = 0;
    if (len) *len = (size_t)n;
    return p;
}

static int file_has(const char *path, const char *phrase) {
    char *t = read_all(path, NULL);
    int ok = t && strstr(t, phrase);
    if (!ok) fprintf(stderr, "  %s lacks \"%s\"; it reads: %.400s\n", path, phrase, t ? t : "(missing)");
    free(t);
    return ok;
}

static int count_of(const char *text, const char *what) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, what)); p += strlen(what)) n++;
    return n;
}

static int exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

/* ---- the synthetic run ---- */

enum { LAYERS = 2, EXPERTS = 8 };
static const int moe_layer_index[LAYERS] = {1, 3};

typedef struct {
    int steps;
    double *loss, *tokps, *val_loss, *val_acc;
    int *load; /* [steps][LAYERS][EXPERTS] */
    int n_eval;
} synthetic_run;

/* Expert 2 of layer 1 gets three times its share, expert 5 of layer 3 none. */
static void make_run(const char *dir, int steps, int with_extras, synthetic_run *run, uint64_t seed) {
    mkdir(dir, 0755);
    char path[600];
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    FILE *f = fopen(path, "wb");
    lm_rng r;
    lm_rng_seed(&r, seed);
    run->steps = steps;
    run->loss = calloc((size_t)steps, sizeof(double));
    run->tokps = calloc((size_t)steps, sizeof(double));
    run->val_loss = calloc((size_t)steps, sizeof(double));
    run->val_acc = calloc((size_t)steps, sizeof(double));
    run->load = calloc((size_t)steps * LAYERS * EXPERTS, sizeof(int));
    run->n_eval = 0;
    if (with_extras)
        fprintf(f, "{\"type\": \"stage\", \"step\": 0, \"stage\": 0, \"seq_len\": 64, \"name\": \"short\"}\n");
    for (int s = 1; s <= steps; s++) {
        double loss = 2.0 + 3.0 * exp(-s / (0.2 * steps)) + 0.1 * lm_rng_normal(&r);
        double tokps = 1000 + 400 * lm_rng_uniform(&r);
        run->loss[s - 1] = loss;
        run->tokps[s - 1] = tokps;
        fprintf(f, "{\"type\": \"train\", \"step\": %d, \"loss\": %.9g, \"aux_loss\": 0, \"lr\": %.9g, "
                "\"grad_norm\": %.9g, \"tokens_per_s\": %.9g, \"step_seconds\": 0.1, \"max_logit\": %.6g, "
                "\"qk_clipped_heads\": 0, \"moe\": [", s, loss, 0.01 * (1 - (double)s / steps), 1 + lm_rng_uniform(&r),
                tokps, 5 + lm_rng_uniform(&r));
        for (int l = 0; l < LAYERS; l++) {
            int *load = run->load + ((size_t)(s - 1) * LAYERS + l) * EXPERTS;
            for (int e = 0; e < EXPERTS; e++) {
                load[e] = 50 + (int)(100 * lm_rng_uniform(&r));
                if (l == 0 && e == 2) load[e] *= 3;
                if (l == 1 && e == 5) load[e] = 0;
            }
            fprintf(f, "%s{\"layer\": %d, \"maxvio_batch\": %.6g, \"maxvio_global\": %.6g, \"cv\": 0.1, \"min\": 0, "
                    "\"max\": 1, \"dead\": 0, \"entropy\": 1, \"bias_min\": 0, \"bias_max\": 0, \"load\": [",
                    l ? ", " : "", moe_layer_index[l], 0.5 + lm_rng_uniform(&r), 0.3 + 0.1 * lm_rng_uniform(&r));
            for (int e = 0; e < EXPERTS; e++) fprintf(f, "%s%d", e ? ", " : "", load[e]);
            fprintf(f, "]}");
        }
        fprintf(f, "]}\n");
        if (s % (steps / 4) == 0) {
            double vl = loss + 0.05 * lm_rng_normal(&r), acc = lm_rng_uniform(&r);
            run->val_loss[run->n_eval] = vl;
            run->val_acc[run->n_eval++] = acc;
            fprintf(f, "{\"type\": \"eval\", \"step\": %d, \"val_loss\": %.9g, \"answer_accuracy\": %.6g}\n", s, vl,
                    acc);
            fprintf(f, "{\"type\": \"checkpoint\", \"step\": %d}\n", s);
        }
        if (with_extras && s == steps / 2) {
            fprintf(f, "{\"type\": \"stage\", \"step\": %d, \"stage\": 1, \"seq_len\": 256, \"name\": \"long\"}\n", s);
            fprintf(f, "{\"type\": \"train\", \"step\": %d, \"lo\n", s); /* a torn line */
            fprintf(f, "{\"type\": \"train\", \"step\": %d}\n", s);      /* a record without its loss */
            fprintf(f, "{\"type\": \"skip\", \"step\": %d, \"reason\": \"non-finite loss or gradient\"}\n", s);
        }
    }
    if (with_extras) {
        fprintf(f, "{\"type\": \"passkey\", \"step\": %d, \"lengths\": [64, 256, 1024], \"depths\": [0, 0.5, 1], "
                "\"accuracy\": [[1, 0.9, 1], [0.8, 0.5, 0.7], [0.2, 0.1, 0.4]]}\n", steps);
        fprintf(f, "{\"type\": \"mqar\", \"step\": %d, \"lengths\": [64, 256], \"queries\": [4, 16], "
                "\"accuracy\": [[1, null], [0.5, 0.25]]}\n", steps);
    }
    fclose(f);
}

static void free_run(synthetic_run *run) {
    free(run->loss);
    free(run->tokps);
    free(run->val_loss);
    free(run->val_acc);
    free(run->load);
}

/* ---- a reader of the embedded PNGs (stored deflate blocks) ---- */

static uint32_t crc32_bitwise(const uint8_t *p, size_t n) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1)));
    }
    return ~c;
}

static uint32_t be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint8_t *base64_decode(const char *s, size_t *n) {
    size_t len = strcspn(s, "\"");
    uint8_t *out = malloc(len / 4 * 3 + 3);
    size_t o = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < len && s[i] != '='; i++) {
        const char *d = strchr("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", s[i]);
        if (!d) {
            free(out);
            return NULL;
        }
        acc = acc << 6 | (uint32_t)(d - "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/");
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[o++] = (uint8_t)(acc >> bits);
        }
    }
    *n = o;
    return out;
}

/* Decode an 8-bit palette PNG to its pixel indices; checks every CRC, the zlib
 * stream's block lengths and its Adler-32. Returns NULL (with a message) on a flaw. */
static uint8_t *png_decode(const uint8_t *p, size_t n, int *w, int *h) {
    static const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    if (n < 8 || memcmp(p, sig, 8)) return NULL;
    uint8_t *z = malloc(n), *pixels = NULL;
    size_t zn = 0, o = 8;
    *w = *h = 0;
    int ok = 1, ended = 0;
    while (ok && o + 12 <= n) {
        uint32_t len = be32(p + o);
        if (o + 12 + len > n) break;
        if (crc32_bitwise(p + o + 4, len + 4) != be32(p + o + 8 + len)) {
            fprintf(stderr, "  bad CRC in chunk %.4s\n", (const char *)p + o + 4);
            ok = 0;
        }
        if (!memcmp(p + o + 4, "IHDR", 4)) {
            *w = (int)be32(p + o + 8);
            *h = (int)be32(p + o + 12);
            ok &= p[o + 16] == 8 && p[o + 17] == 3;
        } else if (!memcmp(p + o + 4, "IDAT", 4)) {
            memcpy(z + zn, p + o + 8, len);
            zn += len;
        } else if (!memcmp(p + o + 4, "IEND", 4)) {
            ended = 1;
        }
        o += 12 + len;
    }
    size_t raw_n = (size_t)*h * (*w + 1);
    uint8_t *raw = malloc(raw_n + 1);
    size_t got = 0, zo = 2;
    int final = 0;
    ok &= ended && zn >= 6 && *w > 0 && *h > 0;
    while (ok && !final && zo + 5 <= zn) {
        final = z[zo] & 1;
        ok &= (z[zo] >> 1) == 0; /* stored block */
        size_t len = z[zo + 1] | (size_t)z[zo + 2] << 8, nlen = z[zo + 3] | (size_t)z[zo + 4] << 8;
        ok &= (len ^ 0xffff) == nlen && got + len <= raw_n && zo + 5 + len <= zn;
        if (ok) memcpy(raw + got, z + zo + 5, len);
        got += len;
        zo += 5 + len;
    }
    if (ok) {
        uint32_t a = 1, b = 0;
        for (size_t i = 0; i < got; i++) {
            a = (a + raw[i]) % 65521;
            b = (b + a) % 65521;
        }
        ok &= final && got == raw_n && zo + 4 == zn && be32(z + zo) == (b << 16 | a);
    }
    if (ok) {
        pixels = malloc((size_t)*w * *h);
        for (int y = 0; y < *h; y++) {
            ok &= raw[(size_t)y * (*w + 1)] == 0; /* filter: none */
            memcpy(pixels + (size_t)y * *w, raw + (size_t)y * (*w + 1) + 1, (size_t)*w);
        }
    }
    if (!ok) {
        fprintf(stderr, "  the PNG is malformed\n");
        free(pixels);
        pixels = NULL;
    }
    free(z);
    free(raw);
    return pixels;
}

/* The number of "x,y" pairs in each points="..." attribute; the largest. */
static int max_points_per_line(const char *html) {
    int most = 0;
    for (const char *p = html; (p = strstr(p, "<polyline")); p++) {
        const char *q = strstr(p, "points=\"");
        if (!q) break;
        q += 8;
        int n = 0;
        for (; *q && *q != '"'; q++) n += *q == ',';
        if (n > most) most = n;
    }
    return most;
}

/* ---- tests ---- */

static void test_report_is_one_self_contained_page_with_every_section(void) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/run", root);
    synthetic_run run;
    make_run(dir, 400, 1, &run, 11);
    lm_config c;
    lm_config_defaults(&c);
    char *cj = lm_config_to_json(&c), cpath[700];
    snprintf(cpath, sizeof cpath, "%s/config.json", dir);
    FILE *f = fopen(cpath, "wb");
    fputs(cj, f);
    fclose(f);
    free(cj);
    char args[800];
    snprintf(args, sizeof args, "report %s", dir);
    CHECK(run_cli(args) == 0, "report of a valid run succeeds");
    CHECK(file_has(path_in("out.txt"), "2 MoE layers x 8 experts"), "the CLI names what it drew");
    CHECK(file_has(path_in("out.txt"), "2 malformed lines skipped"), "the CLI counts the malformed lines");
    char out[700];
    snprintf(out, sizeof out, "%s/report.html", dir);
    size_t n = 0;
    char *html = read_all(out, &n);
    CHECK(html != NULL, "DIR/report.html written by default");
    if (!html) {
        free_run(&run);
        return;
    }
    CHECK(!strncmp(html, "<!DOCTYPE html>", 15), "an HTML5 document");
    CHECK(count_of(html, "<svg") == count_of(html, "</svg>") && count_of(html, "<svg") >= 12,
          "balanced svg elements: %d open, %d closed", count_of(html, "<svg"), count_of(html, "</svg>"));
    CHECK(count_of(html, "<figure") == count_of(html, "</figure>"), "balanced figures");
    CHECK(count_of(html, "<table") == count_of(html, "</table>"), "balanced tables");
    CHECK(!strstr(html, "<script") && !strstr(html, "<SCRIPT"), "no scripts");
    CHECK(!strstr(html, "http"), "nothing referenced by URL");
    CHECK(!strstr(html, "url(") && !strstr(html, "@import") && !strstr(html, "<link"), "no external CSS");
    static const char *const titles[] = {">Summary<", ">Loss", ">Learning rate", ">Gradient norm",
                                         ">Max attention logit",
                                         ">Answer accuracy", "Expert load, layer 1 ", "Expert load, layer 3 ",
                                         "MaxVio, layer 1 ", "MaxVio, layer 3 ", "Passkey retrieval accuracy",
                                         "MQAR accuracy", "MaxVio_batch", "MaxVio_global"};
    for (size_t i = 0; i < sizeof titles / sizeof titles[0]; i++)
        CHECK(strstr(html, titles[i]) != NULL, "title '%s' present", titles[i]);
    CHECK(count_of(html, "class=\"chart heatmap expert-load\"") == LAYERS, "one expert heatmap per MoE layer (%d)",
          count_of(html, "class=\"chart heatmap expert-load\""));
    CHECK(count_of(html, "data:image/png;base64,") == LAYERS, "each heatmap is one embedded image");
    CHECK(count_of(html, "class=\"stage\"") >= 2 * 5, "both stage boundaries drawn on every step chart");
    CHECK(strstr(html, "short \xc2\xb7 64") && strstr(html, "long \xc2\xb7 256"),
          "stages labelled with name and length");
    CHECK(strstr(html, "2 malformed lines skipped") != NULL, "the page names the malformed lines");
    /* the summary says what the log says (float64 references) */
    char want[128];
    snprintf(want, sizeof want, "<td>%.4f</td>", run.loss[run.steps - 1]);
    CHECK(strstr(html, want) != NULL, "final train loss %s", want);
    double best = run.val_loss[0];
    int best_i = 0;
    for (int i = 1; i < run.n_eval; i++)
        if (run.val_loss[i] < best) best = run.val_loss[i], best_i = i;
    snprintf(want, sizeof want, "%.4f at step %d", best, (best_i + 1) * run.steps / 4);
    CHECK(strstr(html, want) != NULL, "best validation loss %s", want);
    snprintf(want, sizeof want, "%.1f%% at step %d", 100 * run.val_acc[run.n_eval - 1], run.steps);
    CHECK(strstr(html, want) != NULL, "last answer accuracy %s", want);
    double *t = malloc((size_t)run.steps * sizeof *t);
    memcpy(t, run.tokps, (size_t)run.steps * sizeof *t);
    for (int i = 1; i < run.steps; i++) /* insertion sort: the median by definition */
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    snprintf(want, sizeof want, "%.0f (median of %d steps)", 0.5 * (t[run.steps / 2 - 1] + t[run.steps / 2]),
             run.steps);
    free(t);
    CHECK(strstr(html, want) != NULL, "median tokens/s %s", want);
    CHECK(strstr(html, "skipped steps (non-finite)</th><td>1<") != NULL, "one skipped step");
    lm_plan p;
    lm_config_plan(&c, c.seq_len, &p);
    snprintf(want, sizeof want, "%.4g M stored", p.total_params / 1e6);
    CHECK(strstr(html, want) != NULL, "parameters from config.json: %s", want);
    CHECK(strstr(html, "checkpoints</th><td>none in the directory (4 written") != NULL,
          "checkpoint list (none kept on disk, 4 logged)");
    /* passkey: 3 lengths x 3 depths, MQAR: 2 x 2, cells labelled in percent */
    CHECK(count_of(html, "</title></rect>") == 9 + 4, "one cell per grid entry (%d)",
          count_of(html, "</title></rect>"));
    CHECK(strstr(html, ">1K</text>") && strstr(html, ">50%</text>"), "grid axes: lengths and depths");
    CHECK(count_of(html, "<title>does not fit</title>") == 1, "a null cell is drawn as not fitting");
    free(html);
    free_run(&run);
}

/* colour = load / mean load, averaged over each step column, on the log2 scale 1/4..4 */
static void test_heatmap_colour_is_load_over_mean_load(void) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/heat", root);
    synthetic_run run;
    make_run(dir, 400, 0, &run, 12);
    lm_report_options o = lm_report_options_default(dir);
    lm_report_summary sum;
    CHECK(lm_report_write(&o, &sum) == LM_OK, "report written: %s", lm_last_error());
    /* 400 steps in at most 300 columns: columns of 2 steps */
    CHECK(sum.heatmap_columns == 200 && sum.moe_layers == LAYERS && sum.experts == EXPERTS,
          "200 columns of 2 steps, %d layers x %d experts (got %d columns)", sum.moe_layers, sum.experts,
          sum.heatmap_columns);
    char out[700];
    snprintf(out, sizeof out, "%s/report.html", dir);
    char *html = read_all(out, NULL);
    const char *p = html;
    for (int l = 0; l < LAYERS && p; l++) {
        p = strstr(p, "data:image/png;base64,");
        if (!p) break;
        p += strlen("data:image/png;base64,");
        size_t n;
        uint8_t *png = base64_decode(p, &n);
        int w, h;
        uint8_t *px = png ? png_decode(png, n, &w, &h) : NULL;
        CHECK(px != NULL, "layer %d: a valid PNG", l);
        if (px) {
            CHECK(w == 200 && h == EXPERTS, "layer %d: %d x %d pixels, want 200 x %d", l, w, h, EXPERTS);
            int worst = 0;
            for (int c = 0; c < w && w == 200 && h == EXPERTS; c++) {
                double sum_e[EXPERTS] = {0}, mean = 0;
                for (int s = 2 * c; s < 2 * c + 2; s++)
                    for (int e = 0; e < EXPERTS; e++) sum_e[e] += run.load[((size_t)s * LAYERS + l) * EXPERTS + e];
                for (int e = 0; e < EXPERTS; e++) mean += sum_e[e] / EXPERTS;
                for (int e = 0; e < EXPERTS; e++) {
                    double ratio = sum_e[e] / mean;
                    double f = ratio > 0 ? (log2(ratio) / 2 + 1) / 2 : 0;
                    f = f < 0 ? 0 : f > 1 ? 1 : f;
                    int want = (int)lround(f * 254), got = px[(size_t)e * w + c];
                    if (abs(got - want) > worst) worst = abs(got - want);
                }
            }
            CHECK(worst <= 1, "layer %d: every pixel is its load / mean load level (worst off by %d)", l, worst);
            if (w == 200 && h == EXPERTS) {
                if (l == 0)
                    CHECK(px[2 * w + 7] > 164, "the overloaded expert is red, over 1.5x the mean (level %d)",
                          px[2 * w + 7]);
                if (l == 1) CHECK(px[5 * w + 7] == 0, "the dead expert is the deepest blue (level %d)", px[5 * w + 7]);
            }
        }
        free(px);
        free(png);
    }
    free(html);
    free_run(&run);
}

static void test_long_runs_are_averaged_into_a_bounded_page(void) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/long", root);
    synthetic_run run;
    make_run(dir, 6000, 1, &run, 13);
    lm_report_options o = lm_report_options_default(dir);
    o.max_points = 100;
    o.max_columns = 40;
    lm_report_summary sum;
    CHECK(lm_report_write(&o, &sum) == LM_OK, "report written: %s", lm_last_error());
    CHECK(sum.train_records == 6000, "every record read (%lld)", (long long)sum.train_records);
    CHECK(sum.heatmap_columns <= 40 && sum.heatmap_columns > 20, "heatmap columns within (cap/2, cap]: %d",
          sum.heatmap_columns);
    char out[700];
    snprintf(out, sizeof out, "%s/report.html", dir);
    char *html = read_all(out, NULL);
    CHECK(html && max_points_per_line(html) <= 100, "at most 100 points per curve (%d)",
          html ? max_points_per_line(html) : -1);
    CHECK(html && strstr(html, "class=\"band\""), "averaged curves show their min-max band");
    CHECK(sum.html_bytes < 200 * 1024, "page of %zu bytes for 6000 steps", sum.html_bytes);
    free(html);
    free_run(&run);
}

static void test_missing_sections_are_left_out(void) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/dense", root);
    mkdir(dir, 0755);
    char path[700];
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    FILE *f = fopen(path, "wb");
    lm_rng r;
    lm_rng_seed(&r, 14);
    for (int s = 1; s <= 30; s++)
        fprintf(f, "{\"type\": \"train\", \"step\": %d, \"loss\": %.6g, \"lr\": 0.01, \"grad_norm\": %.6g}\n", s,
                3 + lm_rng_uniform(&r), 1 + lm_rng_uniform(&r));
    fclose(f);
    lm_report_options o = lm_report_options_default(dir);
    snprintf(path, sizeof path, "%s/elsewhere.html", dir);
    o.out_path = path;
    o.log_loss = 1;
    CHECK(lm_report_write(&o, NULL) == LM_OK, "report of a log without MoE, stages or grids: %s", lm_last_error());
    char *html = read_all(path, NULL);
    CHECK(html != NULL, "written to --out");
    if (html) {
        CHECK(!strstr(html, "expert-load") && !strstr(html, "Passkey") && !strstr(html, "MQAR") &&
              !strstr(html, "class=\"stage\"") && !strstr(html, "Max attention logit"),
              "no empty sections");
        CHECK(strstr(html, "Loss (log scale)") != NULL, "log-scale loss axis on request");
        CHECK(!strstr(html, "malformed"), "no malformed note for a clean log");
    }
    free(html);
}

/* A GPU run's train records carry mfu: the summary gives its median; a CPU
 * run's (above) have none and get no MFU row. */
static void test_gpu_runs_report_their_median_mfu(void) {
    char dir[600], path[700];
    snprintf(dir, sizeof dir, "%s/gpu", root);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL, "cannot write %s", path);
    if (!f) return;
    lm_rng r;
    lm_rng_seed(&r, 15);
    double mfu[7];
    for (int s = 1; s <= 7; s++) {
        mfu[s - 1] = 0.01 + 0.1 * lm_rng_uniform(&r);
        fprintf(f, "{\"type\": \"train\", \"step\": %d, \"loss\": %.6g, \"lr\": 0.01, \"grad_norm\": 1, "
                "\"tokens_per_s\": 1000, \"step_seconds\": 0.1, \"mfu\": %.9g}\n", s, 3 + lm_rng_uniform(&r), mfu[s - 1]);
    }
    fclose(f);
    for (int i = 1; i < 7; i++) /* insertion sort: the median by definition */
        for (int j = i; j > 0 && mfu[j] < mfu[j - 1]; j--) {
            double x = mfu[j];
            mfu[j] = mfu[j - 1];
            mfu[j - 1] = x;
        }
    lm_report_options o = lm_report_options_default(dir);
    CHECK(lm_report_write(&o, NULL) == LM_OK, "report of a GPU run: %s", lm_last_error());
    snprintf(path, sizeof path, "%s/report.html", dir);
    char *html = read_all(path, NULL), want[128];
    snprintf(want, sizeof want, "%.2f%% of 989 TFLOP/s (median of 7 GPU steps)", 100 * mfu[3]);
    CHECK(html && strstr(html, want), "MFU row %s", want);
    free(html);
    snprintf(path, sizeof path, "%s/dense/elsewhere.html", root);
    html = read_all(path, NULL);
    CHECK(html && !strstr(html, "TFLOP/s"), "a run without mfu records has no MFU row");
    free(html);
}

static void test_malformed_records_are_counted_not_fatal(void) {
    char dir[600], path[700];
    snprintf(dir, sizeof dir, "%s/odd", root);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    FILE *f = fopen(path, "wb");
    static const char *const bad[] = {
        "{\"type\": \"train\", \"step\": \"5\", \"loss\": 1}",             /* step not a number */
        "{\"type\": \"train\", \"step\": -1, \"loss\": 1}",                /* negative step */
        "{\"type\": \"train\", \"step\": 1e20, \"loss\": 1}",              /* not an integer */
        "{\"type\": \"train\", \"step\": 99999999999999999999, \"loss\": 1}",
        "{\"type\": \"passkey\", \"lengths\": [1, 2], \"depths\": [0], \"accuracy\": [[1]]}", /* 1 row of 2 */
        "{\"type\": \"mqar\", \"lengths\": [1], \"queries\": [4], \"accuracy\": [[\"x\"]]}",
        "[]",
        "{\"type\": \"train\", \"type\": \"eval\"}", /* duplicate key: invalid for the strict parser */
        "{\"type\": \"eval\", \"step\": 1, } ",
    };
    int n_bad = (int)(sizeof bad / sizeof bad[0]);
    lm_rng r;
    lm_rng_seed(&r, 15);
    for (int i = 0; i < n_bad; i++) {
        fprintf(f, "%s\n", bad[i]);
        fprintf(f, "{\"type\": \"train\", \"step\": %d, \"loss\": %.6g, \"moe\": [{\"layer\": 1, \"load\": [%d, %d, "
                "%d, %d]}]}\n", i + 1, 2 + lm_rng_uniform(&r), 1 + i, 2, 3, 4);
    }
    fprintf(f, "{\"type\": \"train\", \"step\": %d, \"loss\": 1.5, \"moe\": [{\"layer\": 1, \"load\": [1, 2]}]}\n",
            n_bad + 1);
    fprintf(f, "{\"type\": \"future_kind\", \"step\": 3}\n");
    fclose(f);
    lm_report_options o = lm_report_options_default(dir);
    lm_report_summary sum;
    CHECK(lm_report_write(&o, &sum) == LM_OK, "a log with bad lines still gives a report: %s", lm_last_error());
    CHECK(sum.malformed == n_bad, "every bad line counted (%lld of %d)", (long long)sum.malformed, n_bad);
    CHECK(sum.records == n_bad + 2 && sum.train_records == n_bad + 1, "every good line used (%lld records)",
          (long long)sum.records);
    CHECK(sum.passkey_records == 0 && sum.mqar_records == 0, "mis-shaped grids not drawn");
    CHECK(sum.moe_layers == 1 && sum.experts == 4, "heatmap shape from the first record");
    snprintf(path, sizeof path, "%s/report.html", dir);
    char *html = read_all(path, NULL);
    CHECK(html && strstr(html, "9 malformed lines skipped (line 1, 3, 5, 7, 9, 11, 13, 15, ..."),
          "the page lists the first bad line numbers");
    CHECK(html && strstr(html, "1 train record had a list of MoE layers or experts of another shape"),
          "the mis-shaped MoE record is named");
    free(html);
}

static void test_bad_run_directories_fail_clearly(void) {
    char args[800], dir[600];
    snprintf(args, sizeof args, "report %s/no-such-run", root);
    CHECK(run_cli(args) == 1, "missing directory: exit 1");
    CHECK(file_has(path_in("err.txt"), "does not exist"), "missing directory named");
    snprintf(dir, sizeof dir, "%s/nometrics", root);
    mkdir(dir, 0755);
    snprintf(args, sizeof args, "report %s", dir);
    CHECK(run_cli(args) == 1, "no metrics.jsonl: exit 1");
    CHECK(file_has(path_in("err.txt"), "metrics.jsonl"), "the missing file named");
    char path[700];
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    FILE *f = fopen(path, "wb");
    fputs("\n  \n", f);
    fclose(f);
    CHECK(run_cli(args) == 1, "empty metrics.jsonl: exit 1");
    CHECK(file_has(path_in("err.txt"), "is empty"), "empty file named");
    f = fopen(path, "wb");
    fputs("not json\n{\"type\": \"train\"}\n[1, 2]\n", f);
    fclose(f);
    CHECK(run_cli(args) == 1, "only malformed lines: exit 1");
    CHECK(file_has(path_in("err.txt"), "no valid record"), "says there is no valid record");
    snprintf(path, sizeof path, "%s/report.html", dir);
    CHECK(!exists(path), "no report written on failure");
    CHECK(run_cli("report") == 2, "no directory: usage error");
    snprintf(args, sizeof args, "report %s --max-points 1", dir);
    CHECK(run_cli(args) == 2, "bad --max-points: usage error");
}

/* Render the page in headless Chromium (when installed) and check a real image came out. */
static void test_screenshot_in_headless_chromium(void) {
    const char *browser = NULL;
    if (system("command -v chromium > /dev/null 2>&1") == 0) browser = "chromium";
    else if (system("command -v chromium-browser > /dev/null 2>&1") == 0) browser = "chromium-browser";
    if (!browser) SKIP("chromium not installed");
    char html[700], png[700], cmd[3000];
    snprintf(html, sizeof html, "%s/run/report.html", root);
    snprintf(png, sizeof png, "%s/shot.png", root);
    if (html[0] != '/') {
        char cwd[400];
        if (getcwd(cwd, sizeof cwd)) snprintf(html, sizeof html, "%s/%s/run/report.html", cwd, root);
    }
    /* a profile of its own inside the test directory; a minute at most where `timeout` exists */
    const char *limit = system("command -v timeout > /dev/null 2>&1") == 0 ? "timeout 60 " : "";
    snprintf(cmd, sizeof cmd, "%s%s --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir=%s/profile "
             "--screenshot=%s --window-size=1200,3000 file://%s > /dev/null 2>&1", limit, browser, root, png, html);
    CHECK(system(cmd) == 0, "%s rendered the report", browser);
    size_t n = 0;
    uint8_t *p = (uint8_t *)read_all(png, &n);
    CHECK(p && n > 50 * 1024, "a non-trivial screenshot (%zu bytes)", n);
    if (p && n > 24) {
        CHECK(!memcmp(p + 1, "PNG", 3) && be32(p + 16) == 1200 && be32(p + 20) == 3000,
              "a 1200 x 3000 PNG (%u x %u)", be32(p + 16), be32(p + 20));
    }
    free(p);
}

int main(void) {
    if (test_make_tmpdir(root, sizeof root, "report")) return 1;
    RUN(test_report_is_one_self_contained_page_with_every_section);
    RUN(test_heatmap_colour_is_load_over_mean_load);
    RUN(test_long_runs_are_averaged_into_a_bounded_page);
    RUN(test_missing_sections_are_left_out);
    RUN(test_gpu_runs_report_their_median_mfu);
    RUN(test_malformed_records_are_counted_not_fatal);
    RUN(test_bad_run_directories_fail_clearly);
    RUN(test_screenshot_in_headless_chromium);
    test_remove_tree(root);
    return test_summary();
}
