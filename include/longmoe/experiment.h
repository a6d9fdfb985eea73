/* Reproducible experiments that test the recipe's claims at small scale
 * (docs/EXPERIMENTS.md): the same model, data, seed and budget under each
 * variant of one technique, with a table of the results.
 *
 *   balance   none / aux loss / sign / quantile, at 64 experts top-4 and 256 top-8
 *   residual  standard / Block AttnRes (block sizes 2 and 4 sublayers) / Full AttnRes
 *   gate      bounded vs softplus KDA gate
 *   hybrid    all-KDA / 3:1 / 7:1 / all-MLA layouts (8 layers)
 *   context   staged context extension vs training directly at the final length
 *
 * Each variant trains into DIR/<variant>/ (metrics.jsonl, checkpoint,
 * report.html); the
 * table goes to DIR/results.md and one JSON line per variant to
 * DIR/results.jsonl. */
#ifndef LONGMOE_EXPERIMENT_H
#define LONGMOE_EXPERIMENT_H

#include <stdint.h>
#include <stdio.h>

#include "longmoe/config.h"
#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* "balance", "residual", "gate", "hybrid", "context". */
int lm_experiment_known(const char *name);
/* Run experiment `name` on `base` (a preset) for `steps` steps per variant
 * (0: the base's train.steps). Progress goes to `progress` (may be NULL). */
lm_status lm_experiment_run(const char *name, const lm_config *base, int64_t steps, const char *out_dir,
                            FILE *progress);

#ifdef __cplusplus
}
#endif
#endif
